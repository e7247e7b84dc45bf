package membership

import (
	"errors"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"
)

func prefixes(ss ...string) []netip.Prefix {
	var out []netip.Prefix
	for _, s := range ss {
		out = append(out, netip.MustParsePrefix(s))
	}
	return out
}

func TestMemberRoundTrip(t *testing.T) {
	for _, m := range []Member{
		{ContainerID: "c1", IfName: "eth0", HostVeth: "veth1a2b3c4d", HostIfindex: 7, AttachMode: "tcx", IPs: prefixes("10.88.0.5/16")},
		{ContainerID: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", IfName: "eth0", HostVeth: "eni1234567890a", HostIfindex: 1 << 30, AttachMode: "tc",
			IPs: prefixes("10.88.0.5/32", "fd00::5/128", "2001:db8::1/64")},
		{ContainerID: "c2", IfName: "eth0.100", HostVeth: "veth0", HostIfindex: 2, AttachMode: "tc", IPs: prefixes("::ffff:10.0.0.1/128")},
		{ContainerID: "c3", IfName: "a%b", HostVeth: "v%2E", HostIfindex: 3},
		{ContainerID: "c4", IfName: "a&b=c;d", HostVeth: "x+y z", HostIfindex: 4, AttachMode: "tcx"},
		{ContainerID: "c5", IfName: "net@1", HostVeth: "veth,1", HostIfindex: 5},
		{ContainerID: "c.6_x-y", IfName: "eth0"},
		{ContainerID: "c7", IfName: "eth0", IPs: []netip.Prefix{}},
	} {
		text, err := m.MarshalText()
		if err != nil {
			t.Fatalf("%+v: %v", m, err)
		}
		var got Member
		if err := got.UnmarshalText(text); err != nil {
			t.Errorf("%+v: unmarshal %q: %v", m, text, err)
			continue
		}
		if !reflect.DeepEqual(withoutIPs(got), withoutIPs(m)) || !slices.Equal(got.IPs, m.IPs) {
			t.Errorf("round trip of %q: got %+v, want %+v", text, got, m)
		}
		if strings.ContainsRune(string(text), 0) || len(text) > 4095 {
			t.Errorf("record %q cannot be a symlink target", text)
		}
	}
}

// withoutIPs is m without its addresses, which slices.Equal compares
// (a record keeps no difference between none and an empty list).
func withoutIPs(m Member) Member { m.IPs = nil; return m }

func TestMemberCorruptRecords(t *testing.T) {
	valid := "v=1&container=c1&ifname=eth0&veth=veth0&ifindex=7&mode=tcx&ips=10.0.0.1%2F32"
	var m Member
	if err := m.UnmarshalText([]byte(valid)); err != nil {
		t.Fatalf("the valid record: %v", err)
	}
	for _, c := range []struct{ record, msg string }{
		{"", "version"},
		{"%zz", "invalid URL escape"},
		{"v=1&container=c1&ifindex=7;x=1", "semicolon"},
		{strings.Replace(valid, "v=1", "v=2", 1), `version "2"`},
		{strings.Replace(valid, "v=1&", "", 1), `version ""`},
		{strings.Replace(valid, "ifindex=7", "ifindex=seven", 1), "ifindex"},
		{strings.Replace(valid, "&ifindex=7", "", 1), "ifindex"},
		{strings.Replace(valid, "ips=10.0.0.1%2F32", "ips=10.0.0.1", 1), "ips"},
		{strings.Replace(valid, "ips=10.0.0.1%2F32", "ips=10.0.0.1%2F32,", 1), "ips"},
		{strings.Replace(valid, "ips=10.0.0.1%2F32", "ips=10.0.0.1%2F33", 1), "ips"},
		{strings.Replace(valid, "container=c1", "container=", 1), "no container id"},
		{strings.Replace(valid, "container=c1&", "", 1), "no container id"},
		{"garbage", "version"},
	} {
		m := Member{ContainerID: "stale"}
		err := m.UnmarshalText([]byte(c.record))
		if !errors.Is(err, ErrCorruptRecord) || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("UnmarshalText(%q) = %v; want ErrCorruptRecord mentioning %q", c.record, err, c.msg)
		}
	}
}

func TestKey(t *testing.T) {
	m := Member{ContainerID: "abc", IfName: "eth0"}
	if m.Key() != Key("abc", "eth0") || m.Key() != "abc@eth0" {
		t.Errorf("Key = %q", m.Key())
	}
	// Names that differ only in the escaped characters, or in where an
	// escape sequence could be confused with the escaped character, must
	// have distinct keys; and no key may hold what bpffs refuses in a
	// name ('.') or what would make it more than one path element ('/').
	type ci struct{ container, ifname string }
	in := []ci{
		{"c", "eth0.100"}, {"c", "eth0%2E100"}, {"c", "eth0%252E100"}, {"c", "eth0_100"}, {"c", "eth0-100"},
		{"c", "a%b"}, {"c", "a%25b"}, {"c", "a%2525b"},
		{"c", "a/b"}, {"c", "a%2Fb"}, {"c", "a%2fb"},
		{"c", "."}, {"c", "%2E"}, {"c", ".."}, {"c", "%"},
		{"c", "x@y"}, {"c", "x%40y"},
		// Container IDs may contain '.', '_' and '-' (CNI spec).
		{"c.1", "eth0"}, {"c%2E1", "eth0"}, {"c_1", "eth0"}, {"c-1", "eth0"},
		{"c.1", "eth0.1"}, {"c", "1.eth0"},
	}
	seen := map[string]ci{}
	for _, x := range in {
		k := Key(x.container, x.ifname)
		if prev, dup := seen[k]; dup {
			t.Errorf("Key(%q, %q) = Key(%q, %q) = %q", x.container, x.ifname, prev.container, prev.ifname, k)
		}
		seen[k] = x
		if strings.ContainsAny(k, "./\x00") {
			t.Errorf("Key(%q, %q) = %q: not a bpffs name", x.container, x.ifname, k)
		}
	}
}
