package membership

import (
	"fmt"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"
)

// recordVersion is the format of a member record; a reader refuses others.
const recordVersion = "1"

// Member is one container interface attached to an identifier's programs.
type Member struct {
	ContainerID string
	IfName      string // CNI_IFNAME inside the container
	HostVeth    string // host side of the pod's veth
	HostIfindex int
	IPs         []netip.Prefix // the pod's addresses, from the primary plugin's result
	AttachMode  string         // "tcx" or "tc": how the programs were attached
	// AnySource: the pod may send from any address (the plugin's
	// sourceCheck false). Records of builds before the check lack it, and
	// read as false: the check applies.
	AnySource bool
}

// Sources are the exact addresses the member may send from: the host
// address of each of its prefixes.
func (m Member) Sources() []netip.Addr {
	out := make([]netip.Addr, 0, len(m.IPs))
	for _, p := range m.IPs {
		if a := p.Addr(); !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	return out
}

// Key names the member's directory: the container ID, '@', and the interface
// name, both with '%', '.' and '/' escaped (bpffs refuses '.', which the CNI
// spec allows in both; container IDs cannot contain '@', so keys are unique
// per container interface).
func (m Member) Key() string {
	return Key(m.ContainerID, m.IfName)
}

var keyEscaper = strings.NewReplacer("%", "%25", ".", "%2E", "/", "%2F")

// Key is Member.Key for a container interface.
func Key(containerID, ifname string) string {
	return keyEscaper.Replace(containerID) + "@" + keyEscaper.Replace(ifname)
}

// MarshalText encodes the record stored as the target of a bpffs symlink
// (bpffs holds no regular files).
func (m Member) MarshalText() ([]byte, error) {
	v := url.Values{}
	v.Set("v", recordVersion)
	v.Set("container", m.ContainerID)
	v.Set("ifname", m.IfName)
	v.Set("veth", m.HostVeth)
	v.Set("ifindex", strconv.Itoa(m.HostIfindex))
	v.Set("mode", m.AttachMode)
	ips := make([]string, len(m.IPs))
	for i, p := range m.IPs {
		ips[i] = p.String()
	}
	v.Set("ips", strings.Join(ips, ","))
	if m.AnySource {
		// Only when set: a record without it reads the same in every
		// build, so a rollback finds nothing new in it.
		v.Set("sources", "any")
	}
	return []byte(v.Encode()), nil
}

// UnmarshalText decodes a record written by MarshalText.
func (m *Member) UnmarshalText(b []byte) error {
	v, err := url.ParseQuery(string(b))
	if err != nil {
		return fmt.Errorf("%w: %w", ErrCorruptRecord, err)
	}
	if got := v.Get("v"); got != recordVersion {
		return fmt.Errorf("%w: version %q, want %q", ErrCorruptRecord, got, recordVersion)
	}
	idx, err := strconv.Atoi(v.Get("ifindex"))
	if err != nil {
		return fmt.Errorf("%w: ifindex: %w", ErrCorruptRecord, err)
	}
	*m = Member{
		ContainerID: v.Get("container"),
		IfName:      v.Get("ifname"),
		HostVeth:    v.Get("veth"),
		HostIfindex: idx,
		AttachMode:  v.Get("mode"),
		AnySource:   v.Get("sources") == "any",
	}
	if s := v.Get("ips"); s != "" {
		for _, ip := range strings.Split(s, ",") {
			p, err := netip.ParsePrefix(ip)
			if err != nil {
				return fmt.Errorf("%w: ips: %w", ErrCorruptRecord, err)
			}
			m.IPs = append(m.IPs, p)
		}
	}
	if m.ContainerID == "" {
		return fmt.Errorf("%w: no container id", ErrCorruptRecord)
	}
	return nil
}
