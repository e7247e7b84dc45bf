package main

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/podfence/podfence/pkg/attach"
	"github.com/podfence/podfence/pkg/policy"
)

// prevResultJSON is what ptp reports in a chain of the given version: the
// host veth (no sandbox), the pod's eth0 and one address on it. Before 1.0.0
// an address carries its IP version.
func prevResultJSON(cniVersion string) string {
	ipVersion := ""
	if cniVersion == "0.4.0" {
		ipVersion = `"version": "4", `
	}
	return fmt.Sprintf(`{
		"cniVersion": %q,
		"interfaces": [
			{"name": "veth1234abcd", "mac": "aa:bb:cc:dd:ee:01"},
			{"name": "eth0", "mac": "aa:bb:cc:dd:ee:02", "sandbox": "/var/run/netns/pod"}
		],
		"ips": [{%s"interface": 1, "address": "10.88.0.5/16", "gateway": "10.88.0.1"}],
		"dns": {}
	}`, cniVersion, ipVersion)
}

// conf builds a podfence configuration of version 1.0.0 with extra keys
// (raw JSON values) after the runtime's.
func conf(extra ...string) []byte {
	parts := append([]string{`"cniVersion": "1.0.0"`, `"name": "k8s-pod-network"`, `"type": "podfence"`}, extra...)
	return []byte("{" + strings.Join(parts, ", ") + "}")
}

func withPrev(extra ...string) []byte {
	return conf(append([]string{`"prevResult": ` + prevResultJSON("1.0.0")}, extra...)...)
}

func TestParseConfigDefaults(t *testing.T) {
	for _, needPrev := range []bool{false, true} {
		c, err := parseConfig(withPrev(), needPrev)
		if err != nil {
			t.Fatalf("needPrevResult=%v: %v", needPrev, err)
		}
		if c.PinRoot != defaultPinRoot || c.PolicyDir != defaultPolicyDir {
			t.Errorf("pinRoot %q, policyDir %q; want the defaults %q, %q", c.PinRoot, c.PolicyDir, defaultPinRoot, defaultPolicyDir)
		}
		if c.mode != policy.ModeStandard || c.attachMode != attach.ModeAuto || c.logLevel != slog.LevelInfo || c.LogFile != "" {
			t.Errorf("mode %q, attachMode %q, logLevel %v, logFile %q; want standard, auto, info, none", c.mode, c.attachMode, c.logLevel, c.LogFile)
		}
		if c.PrevResult == nil {
			t.Error("prevResult not parsed")
		}
	}
	// DEL, GC and STATUS run without a prevResult.
	c, err := parseConfig(conf(), false)
	if err != nil {
		t.Fatal(err)
	}
	if c.PrevResult != nil || c.PinRoot != defaultPinRoot {
		t.Errorf("without prevResult: prevResult %v, pinRoot %q", c.PrevResult, c.PinRoot)
	}
}

func TestParseConfigEveryKey(t *testing.T) {
	c, err := parseConfig(withPrev(
		`"pinRoot": "/sys/fs/bpf/pf"`,
		`"policyDir": "/etc/pf"`,
		`"enforcingMode": "strict"`,
		`"attachMode": "tc"`,
		`"logFile": "/var/log/pf.log"`,
		`"logLevel": "debug"`,
		// Keys a runtime adds: all accepted.
		`"capabilities": {"portMappings": true}`,
		`"ipam": {}`,
		`"dns": {"nameservers": ["10.0.0.10"]}`,
		`"runtimeConfig": {"portMappings": []}`,
		`"args": {"cni": {}}`,
		`"cni.dev/valid-attachments": [{"containerID": "c1", "ifname": "eth0"}]`,
	), true)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ name, got, want string }{
		{"pinRoot", c.PinRoot, "/sys/fs/bpf/pf"},
		{"policyDir", c.PolicyDir, "/etc/pf"},
		{"enforcingMode", string(c.mode), string(policy.ModeStrict)},
		{"attachMode", string(c.attachMode), string(attach.ModeTC)},
		{"logFile", c.LogFile, "/var/log/pf.log"},
		{"logLevel", c.logLevel.String(), slog.LevelDebug.String()},
	} {
		if c.got != c.want {
			t.Errorf("%s = %q, want %q", c.name, c.got, c.want)
		}
	}
	if len(c.ValidAttachments) != 1 || c.ValidAttachments[0].ContainerID != "c1" {
		t.Errorf("valid attachments %+v", c.ValidAttachments)
	}

	for _, lv := range []struct {
		in   string
		want slog.Level
	}{{"debug", slog.LevelDebug}, {"info", slog.LevelInfo}, {"warn", slog.LevelWarn}, {"error", slog.LevelError}} {
		c, err := parseConfig(conf(`"logLevel": "`+lv.in+`"`), false)
		if err != nil || c.logLevel != lv.want {
			t.Errorf("logLevel %q: %v, %v", lv.in, c, err)
		}
	}
	for _, m := range []attach.Mode{attach.ModeAuto, attach.ModeTCX, attach.ModeTC} {
		c, err := parseConfig(conf(`"attachMode": "`+string(m)+`"`), false)
		if err != nil || c.attachMode != m {
			t.Errorf("attachMode %q: %v", m, err)
		}
	}
	for _, m := range []policy.Mode{policy.ModeStandard, policy.ModeStrict} {
		c, err := parseConfig(conf(`"enforcingMode": "`+string(m)+`"`), false)
		if err != nil || c.mode != m {
			t.Errorf("enforcingMode %q: %v", m, err)
		}
	}
	c, err = parseConfig(conf(`"ctV4Entries": 262144, "ctV6Entries": 1024`), false)
	if err != nil || c.CTv4Entries != 262144 || c.CTv6Entries != 1024 {
		t.Errorf("ctV4Entries/ctV6Entries: %+v %v", c, err)
	}
	for _, bad := range []string{`"ctV4Entries": 100`, `"ctV6Entries": 33554432`, `"ctV4Entries": -1`} {
		if _, err := parseConfig(conf(bad), false); err == nil {
			t.Errorf("%s: accepted", bad)
		}
	}
}

// TestParseConfigGCKeys: libcni's GCNetworkList injects the valid
// attachments under both the spec's name and the one an earlier draft used
// (containernetworking/cni#1101); both must be accepted, and a runtime
// that sends only the old name must not have podfence GC everything.
func TestParseConfigGCKeys(t *testing.T) {
	both := `[{"containerID": "c1", "ifname": "eth0"}]`
	c, err := parseConfig([]byte(`{"cniVersion": "1.1.0", "name": "n", "type": "podfence",
		"cni.dev/valid-attachments": `+both+`, "cni.dev/attachments": `+both+`}`), false)
	if err != nil {
		t.Fatalf("config as libcni's GC sends it: %v", err)
	}
	if len(c.ValidAttachments) != 1 || c.ValidAttachments[0] != (types.GCAttachment{ContainerID: "c1", IfName: "eth0"}) {
		t.Errorf("valid attachments %+v", c.ValidAttachments)
	}
	c, err = parseConfig([]byte(`{"cniVersion": "1.1.0", "name": "n", "type": "podfence",
		"cni.dev/attachments": `+both+`}`), false)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.ValidAttachments) != 1 || c.ValidAttachments[0].ContainerID != "c1" {
		t.Errorf("old key only: valid attachments %+v, want c1/eth0", c.ValidAttachments)
	}
}

func TestParseConfigErrors(t *testing.T) {
	for _, c := range []struct {
		name     string
		stdin    []byte
		needPrev bool
		msgs     []string // substrings the message must contain
	}{
		{"unknown key", withPrev(`"enforcingMod": "strict"`), true, []string{"enforcingMod", "enforcingMode"}},
		{"two unknown keys", conf(`"zeta": 1`, `"alpha": 2`), false, []string{"alpha, zeta"}},
		{"bad enforcingMode", withPrev(`"enforcingMode": "enforce"`), true, []string{"enforcingMode", `"enforce"`, "standard or strict"}},
		{"enforcingMode case", withPrev(`"enforcingMode": "Strict"`), true, []string{"enforcingMode", "standard or strict"}},
		{"bad attachMode", withPrev(`"attachMode": "xdp"`), true, []string{"attachMode", `"xdp"`, "auto, tcx or tc"}},
		{"bad logLevel", withPrev(`"logLevel": "trace"`), true, []string{"logLevel", `"trace"`, "debug, info, warn or error"}},
		{"relative pinRoot", withPrev(`"pinRoot": "sys/fs/bpf/podfence"`), true, []string{"pinRoot", "absolute path"}},
		{"dot pinRoot", conf(`"pinRoot": "./podfence"`), false, []string{"pinRoot", "absolute path"}},
		{"pinRoot not a string", withPrev(`"pinRoot": 5`), true, []string{"decode config"}},
		{"missing prevResult for ADD/CHECK", conf(), true, []string{"no prevResult", "chained after"}},
		{"null prevResult", conf(`"prevResult": null`), true, []string{"no prevResult"}},
		{"malformed JSON", []byte(`{"cniVersion": "1.0.0", "type": "podfence"`), false, []string{"not a JSON object"}},
		{"not an object", []byte(`["podfence"]`), false, []string{"not a JSON object"}},
		{"empty stdin", nil, false, []string{"not a JSON object"}},
		{"prevResult of the wrong shape", conf(`"prevResult": {"cniVersion": "1.0.0", "ips": "10.0.0.1"}`), true, []string{"prevResult"}},
		{"prevResult bad address", conf(`"prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "10.0.0.300/24"}]}`), true, []string{"prevResult"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := parseConfig(c.stdin, c.needPrev)
			assertCNIError(t, err, types.ErrInvalidNetworkConfig, c.msgs...)
		})
	}
}

func TestParseConfigPrevResultVersions(t *testing.T) {
	for _, v := range []string{"0.4.0", "1.0.0", "1.1.0"} {
		t.Run(v, func(t *testing.T) {
			stdin := fmt.Sprintf(`{"cniVersion": %q, "name": "n", "type": "podfence", "prevResult": %s}`, v, prevResultJSON(v))
			c, err := parseConfig([]byte(stdin), true)
			if err != nil {
				t.Fatal(err)
			}
			if got := c.PrevResult.Version(); got != v {
				t.Errorf("prevResult parsed as version %s, want %s", got, v)
			}
			r, err := current.NewResultFromResult(c.PrevResult)
			if err != nil {
				t.Fatal(err)
			}
			if len(r.Interfaces) != 2 || r.Interfaces[0].Name != "veth1234abcd" || r.Interfaces[1].Sandbox == "" {
				t.Errorf("interfaces %+v", r.Interfaces)
			}
			if len(r.IPs) != 1 || r.IPs[0].Address.String() != "10.88.0.5/16" {
				t.Errorf("ips %+v", r.IPs)
			}
			if got := podIPs(r); len(got) != 1 || got[0].String() != "10.88.0.5/16" {
				t.Errorf("podIPs = %v", got)
			}
		})
	}
	// Before 1.0.0 a result may omit its version; it is the config's.
	stdin := `{"cniVersion": "0.4.0", "name": "n", "type": "podfence", "prevResult": {"ips": [{"version": "4", "address": "10.88.0.5/16"}]}}`
	if c, err := parseConfig([]byte(stdin), true); err != nil || c.PrevResult.Version() != "0.4.0" {
		t.Errorf("prevResult without cniVersion: %v", err)
	}
}

// assertCNIError checks that err is a *types.Error with the code and a
// message containing every substring.
func assertCNIError(t *testing.T, err error, code uint, msgs ...string) {
	t.Helper()
	var e *types.Error
	if !errors.As(err, &e) {
		t.Fatalf("got %v (%T), want a CNI error with code %d", err, err, code)
	}
	if e.Code != code {
		t.Errorf("code %d, want %d (message %q)", e.Code, code, e.Msg)
	}
	for _, m := range msgs {
		if !strings.Contains(e.Msg, m) {
			t.Errorf("message %q does not contain %q", e.Msg, m)
		}
	}
}

// sourceCheck defaults to on; false turns it off; anything else is a
// config error. A prevResult the check cannot work with is refused while
// it is on.
func TestSourceCheckSetting(t *testing.T) {
	for _, c := range []struct {
		extra []string
		want  bool
	}{{nil, true}, {[]string{`"sourceCheck": true`}, true}, {[]string{`"sourceCheck": false`}, false}} {
		conf, err := parseConfig(withPrev(c.extra...), true)
		if err != nil || conf.sourceCheck() != c.want {
			t.Errorf("%v: sourceCheck %v, %v; want %v", c.extra, conf.sourceCheck(), err, c.want)
		}
	}
	if _, err := parseConfig(withPrev(`"sourceCheck": "no"`), true); err == nil {
		t.Error(`sourceCheck "no" accepted`)
	}

	noIPs := &current.Result{CNIVersion: "1.0.0"}
	nine := &current.Result{CNIVersion: "1.0.0"}
	for i := range 9 {
		nine.IPs = append(nine.IPs, &current.IPConfig{Address: *mustIPNet(t, fmt.Sprintf("10.88.0.%d/24", i+1))})
	}
	for _, c := range []struct {
		name  string
		check bool
		prev  *current.Result
		want  string
	}{
		{"no address, check on", true, noIPs, "no address"},
		{"no address, check off", false, noIPs, ""},
		{"nine addresses", true, nine, "at most 8"},
		{"nine addresses, check off", false, nine, "at most 8"},
	} {
		conf := &PluginConf{SourceCheck: &c.check}
		err := checkSources(conf, c.prev)
		var cniErr *types.Error
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%s: %v", c.name, err)
		case c.want != "" && (!errors.As(err, &cniErr) || cniErr.Code != types.ErrInvalidNetworkConfig || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%s: %v, want error 7 with %q", c.name, err, c.want)
		}
	}
}

func mustIPNet(t *testing.T, s string) *net.IPNet {
	t.Helper()
	ip, n, err := net.ParseCIDR(s)
	if err != nil {
		t.Fatal(err)
	}
	n.IP = ip
	return n
}

// A key that is set means what it says: its zero value is an error, not
// the default, which leaving the key out gives.
func TestParseConfigZeroIsNotDefault(t *testing.T) {
	for _, kv := range []string{`"pinRoot": ""`, `"policyDir": ""`, `"enforcingMode": ""`, `"attachMode": ""`,
		`"logLevel": ""`, `"ctV4Entries": 0`, `"ctV6Entries": 0`} {
		_, err := parseConfig(withPrev(kv), true)
		var cniErr *types.Error
		if !errors.As(err, &cniErr) || cniErr.Code != types.ErrInvalidNetworkConfig || !strings.Contains(err.Error(), "leave the key out") {
			t.Errorf("%s: %v, want error 7 saying to leave the key out", kv, err)
		}
	}
}
