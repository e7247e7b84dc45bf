package policy

import (
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

var seedFlag = flag.Uint64("seed", 0, "seed of TestCompileMatchesAllows (0: from the clock)")

var (
	pfx = netip.MustParsePrefix
	ip  = netip.MustParseAddr
)

func tcp(first, last uint16) PortRange { return PortRange{ProtocolTCP, first, last} }
func udp(first, last uint16) PortRange { return PortRange{ProtocolUDP, first, last} }

func TestPortRangeContains(t *testing.T) {
	tests := []struct {
		r     PortRange
		proto uint8
		port  uint16
		want  bool
	}{
		{allPorts, 1, 0, true}, // ICMP has no ports; only "any" matches it
		{allPorts, 6, 65535, true},
		{tcp(0, 65535), 1, 0, false},
		{tcp(80, 90), 6, 80, true},
		{tcp(80, 90), 6, 90, true},
		{tcp(80, 90), 6, 91, false},
		{tcp(80, 90), 6, 79, false},
		{tcp(80, 90), 17, 80, false},
		{PortRange{ProtocolSCTP, 5, 5}, 132, 5, true},
	}
	for _, tt := range tests {
		if got := tt.r.Contains(tt.proto, tt.port); got != tt.want {
			t.Errorf("%v.Contains(%d, %d) = %v, want %v", tt.r, tt.proto, tt.port, got, tt.want)
		}
	}
}

func TestAllows(t *testing.T) {
	web := DirectionPolicy{Isolated: true, Rules: []Rule{
		{CIDR: pfx("10.1.0.0/16"), Except: []netip.Prefix{pfx("10.1.5.0/24")}, Ports: []PortRange{tcp(80, 90)}},
		{CIDR: pfx("10.1.5.128/25"), Ports: []PortRange{udp(53, 53)}},
		{CIDR: pfx("fd00::/64"), Ports: []PortRange{allPorts}},
	}}
	tests := []struct {
		name  string
		d     DirectionPolicy
		addr  string
		proto uint8
		port  uint16
		want  bool
	}{
		{"not isolated", DirectionPolicy{}, "1.2.3.4", 6, 1, true},
		{"isolated without rules", DirectionPolicy{Isolated: true}, "1.2.3.4", 6, 1, false},
		{"in cidr and port", web, "10.1.0.1", 6, 80, true},
		{"wrong port", web, "10.1.0.1", 6, 91, false},
		{"wrong protocol", web, "10.1.0.1", 17, 80, false},
		{"icmp against ports", web, "10.1.0.1", 1, 0, false},
		{"outside cidr", web, "10.2.0.1", 6, 80, false},
		{"in except", web, "10.1.5.1", 6, 80, false},
		{"in except, other rule", web, "10.1.5.200", 17, 53, true},
		{"in except, other rule, its port only", web, "10.1.5.200", 6, 80, false},
		{"mapped address is IPv4", web, "::ffff:10.1.0.1", 6, 85, true},
		{"v6 any port", web, "fd00::5", 1, 0, true},
		{"v6 outside", web, "fd00:1::5", 6, 80, false},
		{"zone ignored", web, "fd00::5%eth0", 6, 80, true},
		{"v4 never matches v6 any", DirectionPolicy{Isolated: true, Rules: []Rule{{CIDR: pfx("::/0"), Ports: []PortRange{allPorts}}}}, "10.0.0.1", 6, 80, false},
		{"v6 never matches v4 any", DirectionPolicy{Isolated: true, Rules: []Rule{{CIDR: pfx("0.0.0.0/0"), Ports: []PortRange{allPorts}}}}, "fd00::1", 6, 80, false},
		{"rule without ports allows nothing", DirectionPolicy{Isolated: true, Rules: []Rule{{CIDR: pfx("0.0.0.0/0")}}}, "10.0.0.1", 6, 80, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.d.Allows(ip(tt.addr), tt.proto, tt.port); got != tt.want {
				t.Errorf("Allows(%s, %d, %d) = %v, want %v", tt.addr, tt.proto, tt.port, got, tt.want)
			}
		})
	}
}

func TestMergePorts(t *testing.T) {
	sctp := func(first, last uint16) PortRange { return PortRange{ProtocolSCTP, first, last} }
	tests := []struct {
		name   string
		in     []PortRange
		want   []PortRange
		rounds int
	}{
		{"none", nil, nil, 0},
		{"overlap and adjacency", []PortRange{sctp(150, 300), tcp(11, 20), udp(53, 53), tcp(5, 6), sctp(100, 200), tcp(1, 10)},
			[]PortRange{tcp(1, 20), udp(53, 53), sctp(100, 300)}, 0},
		{"gap kept", []PortRange{tcp(1, 10), tcp(12, 20)}, []PortRange{tcp(1, 10), tcp(12, 20)}, 0},
		{"protocol full range absorbs", []PortRange{udp(53, 53), tcp(80, 80), udp(0, 65535), udp(7, 9)}, []PortRange{tcp(80, 80), udp(0, 65535)}, 0},
		{"top port adjacency does not overflow", []PortRange{tcp(65535, 65535), tcp(0, 0), tcp(65534, 65535)}, []PortRange{tcp(0, 0), tcp(65534, 65535)}, 0},
		{"any absorbs everything", []PortRange{tcp(80, 80), allPorts, udp(0, 65535)}, []PortRange{allPorts}, 0},
		{"duplicates", []PortRange{tcp(80, 80), tcp(80, 80)}, []PortRange{tcp(80, 80)}, 0},
		{"empty range dropped", []PortRange{tcp(9, 8)}, nil, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := slices.Clone(tt.in)
			if got := mergePorts(tt.in); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("mergePorts(%v) = %v, want %v", tt.in, got, tt.want)
			}
			if !reflect.DeepEqual(in, tt.in) {
				t.Errorf("mergePorts modified its input: %v", tt.in)
			}
		})
	}
}

func TestCompile(t *testing.T) {
	ranges := func(n int) []PortRange { // n disjoint single ports
		var rs []PortRange
		for i := range n {
			rs = append(rs, tcp(uint16(2*i+1), uint16(2*i+1)))
		}
		return rs
	}
	tests := []struct {
		name     string
		d        DirectionPolicy
		v4, v6   []Entry
		errMatch string
	}{
		{name: "not isolated", d: DirectionPolicy{Rules: []Rule{{CIDR: pfx("10.0.0.0/8"), Ports: []PortRange{allPorts}}}}},
		{name: "isolated without rules", d: DirectionPolicy{Isolated: true}},
		{
			name: "except and overlap",
			d: DirectionPolicy{Isolated: true, Rules: []Rule{
				{CIDR: pfx("10.1.0.0/16"), Except: []netip.Prefix{pfx("10.1.5.0/24")}, Ports: []PortRange{tcp(80, 90), udp(0, 65535)}},
				{CIDR: pfx("10.0.0.0/8"), Ports: []PortRange{tcp(443, 443)}},
				{CIDR: pfx("fd00::1/128"), Ports: []PortRange{allPorts}},
			}},
			v4: []Entry{
				{pfx("10.0.0.0/8"), []PortRange{tcp(443, 443)}},
				{pfx("10.1.0.0/16"), []PortRange{tcp(80, 90), tcp(443, 443), udp(0, 65535)}},
				{pfx("10.1.5.0/24"), []PortRange{tcp(443, 443)}},
			},
			v6: []Entry{{pfx("fd00::1/128"), []PortRange{allPorts}}},
		},
		{
			name: "except is a deny entry",
			d:    DirectionPolicy{Isolated: true, Rules: []Rule{{CIDR: pfx("::/0"), Except: []netip.Prefix{pfx("fd00::/8")}, Ports: []PortRange{allPorts}}}},
			v6:   []Entry{{pfx("::/0"), []PortRange{allPorts}}, {pfx("fd00::/8"), nil}},
		},
		{
			name: "except equal to another rule's cidr",
			d: DirectionPolicy{Isolated: true, Rules: []Rule{
				{CIDR: pfx("10.0.0.0/8"), Except: []netip.Prefix{pfx("10.1.0.0/16")}, Ports: []PortRange{tcp(80, 80)}},
				{CIDR: pfx("10.1.0.0/16"), Ports: []PortRange{udp(53, 53)}},
			}},
			v4: []Entry{{pfx("10.0.0.0/8"), []PortRange{tcp(80, 80)}}, {pfx("10.1.0.0/16"), []PortRange{udp(53, 53)}}},
		},
		{
			name: "masked, deduplicated, sorted by address then bits",
			d: DirectionPolicy{Isolated: true, Rules: []Rule{
				{CIDR: pfx("10.0.0.0/16"), Ports: []PortRange{tcp(1, 1)}},
				{CIDR: pfx("10.1.2.3/8"), Ports: []PortRange{tcp(2, 2)}},
				{CIDR: pfx("9.0.0.0/8"), Ports: []PortRange{tcp(3, 3)}},
				{CIDR: pfx("10.0.0.0/8"), Ports: []PortRange{tcp(2, 2)}},
			}},
			v4: []Entry{
				{pfx("9.0.0.0/8"), []PortRange{tcp(3, 3)}},
				{pfx("10.0.0.0/8"), []PortRange{tcp(2, 2)}},
				{pfx("10.0.0.0/16"), []PortRange{tcp(1, 2)}},
			},
		},
		{
			name: "any rule subsumes",
			d: DirectionPolicy{Isolated: true, Rules: []Rule{
				{CIDR: pfx("10.0.0.0/8"), Ports: []PortRange{tcp(80, 80)}},
				{CIDR: pfx("10.0.0.0/8"), Ports: []PortRange{allPorts}},
			}},
			v4: []Entry{{pfx("10.0.0.0/8"), []PortRange{allPorts}}},
		},
		{
			name: "MaxPortRanges fit",
			d:    DirectionPolicy{Isolated: true, Rules: []Rule{{CIDR: pfx("10.0.0.0/8"), Ports: ranges(MaxPortRanges)}}},
			v4:   []Entry{{pfx("10.0.0.0/8"), ranges(MaxPortRanges)}},
		},
		{
			name: "many ranges that merge fit",
			d: DirectionPolicy{Isolated: true, Rules: []Rule{
				{CIDR: pfx("10.0.0.0/8"), Ports: ranges(MaxPortRanges + 1)},
				{CIDR: pfx("10.0.0.0/8"), Ports: []PortRange{tcp(0, 1000)}},
			}},
			v4: []Entry{{pfx("10.0.0.0/8"), []PortRange{tcp(0, 1000)}}},
		},
		{
			name:     "too many ranges",
			d:        DirectionPolicy{Isolated: true, Rules: []Rule{{CIDR: pfx("10.0.0.0/8"), Ports: ranges(MaxPortRanges + 1)}}},
			errMatch: "prefix 10.0.0.0/8: 65 port ranges after merging, at most 64",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v4, v6, err := tt.d.Compile()
			if tt.errMatch != "" {
				if !errors.Is(err, ErrTooManyPortRanges) || !strings.Contains(err.Error(), tt.errMatch) {
					t.Fatalf("error %v, want ErrTooManyPortRanges containing %q", err, tt.errMatch)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(v4, tt.v4) || !reflect.DeepEqual(v6, tt.v6) {
				t.Errorf("got  v4 %v v6 %v\nwant v4 %v v6 %v", v4, v6, tt.v4, tt.v6)
			}
		})
	}
}

// lookup is what the datapath does with Compile's output: a longest-prefix
// match in the family's trie, then a scan of the entry's port ranges.
func lookup(v4, v6 []Entry, addr netip.Addr, proto uint8, port uint16) bool {
	e, ok := longestMatch(v4, v6, addr, func(e Entry) netip.Prefix { return e.Prefix })
	return ok && slices.ContainsFunc(e.Ports, func(r PortRange) bool { return r.Contains(proto, port) })
}

// longestMatch is an LPM trie lookup: of the family's entries, the one
// with the longest prefix holding addr.
func longestMatch[E any](v4, v6 []E, addr netip.Addr, prefix func(E) netip.Prefix) (best E, ok bool) {
	addr = addr.Unmap()
	entries := v6
	if addr.Is4() {
		entries = v4
	}
	for _, e := range entries {
		if p := prefix(e); p.Contains(addr) && (!ok || p.Bits() > prefix(best).Bits()) {
			best, ok = e, true
		}
	}
	return best, ok
}

// TestCompileMatchesAllows checks Compile against Allows on random rule sets
// whose prefixes overlap heavily. Replay a failure with
// go test ./pkg/policy -run TestCompileMatchesAllows -seed=N.
func TestCompileMatchesAllows(t *testing.T) {
	seed := *seedFlag
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, seed))
	checked, allowed := 0, 0
	for round := range 500 {
		d := DirectionPolicy{Isolated: true}
		for range 1 + rng.IntN(8) {
			d.Rules = append(d.Rules, randRule(rng))
		}
		v4, v6, err := d.Compile()
		if err != nil {
			t.Fatalf("seed %d round %d: %v\nrules %v", seed, round, err, d.Rules)
		}
		checkEntries(t, v4, true)
		checkEntries(t, v6, false)

		var addrs []netip.Addr
		for _, r := range d.Rules {
			for _, p := range append([]netip.Prefix{r.CIDR}, r.Except...) {
				first, last := p.Masked().Addr(), lastAddr(p)
				addrs = append(addrs, first, last, first.Prev(), last.Next())
			}
		}
		for range 100 {
			addrs = append(addrs, clusterAddr(rng, false), clusterAddr(rng, true))
		}
		a := clusterAddr(rng, false).As16() // IPv4-mapped IPv6
		addrs = append(addrs, netip.AddrFrom16(a))
		for _, addr := range addrs {
			if !addr.IsValid() { // Prev of 0.0.0.0, Next of the last address
				continue
			}
			for range 4 {
				proto := []uint8{1, 6, 17, 132, 47}[rng.IntN(5)]
				port := uint16(rng.IntN(26))
				if rng.IntN(10) == 0 {
					port = 65535
				}
				want := d.Allows(addr, proto, port)
				if got := lookup(v4, v6, addr, proto, port); got != want {
					t.Fatalf("seed %d round %d: %s proto %d port %d: lookup %v, Allows %v\nrules %v\nv4 %v\nv6 %v",
						seed, round, addr, proto, port, got, want, d.Rules, v4, v6)
				}
				checked++
				if want {
					allowed++
				}
			}
		}
	}
	t.Logf("%d lookups (%d allowed) agree with Allows", checked, allowed)
}

// checkEntries checks the shape the datapath relies on: right family,
// masked, unique and sorted prefixes, merged sorted ports within the limit.
func checkEntries(t *testing.T, entries []Entry, is4 bool) {
	t.Helper()
	var prefixes []netip.Prefix
	for _, e := range entries {
		prefixes = append(prefixes, e.Prefix)
		if len(e.Ports) > MaxPortRanges || !reflect.DeepEqual(mergePorts(e.Ports), e.Ports) {
			t.Fatalf("entry %v: ports not merged", e)
		}
	}
	checkPrefixes(t, prefixes, is4)
}

// checkPrefixes checks a trie's prefixes: right family, masked, unique and
// sorted.
func checkPrefixes(t *testing.T, prefixes []netip.Prefix, is4 bool) {
	t.Helper()
	for i, p := range prefixes {
		if p.Addr().Is4() != is4 || p != p.Masked() {
			t.Fatalf("prefix %v: wrong family or not masked", p)
		}
		if i > 0 {
			prev := prefixes[i-1]
			if c := prev.Addr().Compare(p.Addr()); c > 0 || c == 0 && prev.Bits() >= p.Bits() {
				t.Fatalf("prefixes %v, %v: not sorted or duplicate", prev, p)
			}
		}
	}
}

// clusterAddr returns an address in a small range (10.0.0.0/22 or fd00::/118),
// so that random prefixes overlap.
func clusterAddr(rng *rand.Rand, v6 bool) netip.Addr {
	base := ip("10.0.0.0")
	if v6 {
		base = ip("fd00::")
	}
	return withLow(base, rng.IntN(1<<10))
}

// withLow sets bits of the two last bytes of a.
func withLow(a netip.Addr, low int) netip.Addr {
	b := a.As16()
	b[14] |= byte(low >> 8)
	b[15] |= byte(low)
	if a.Is4() {
		return netip.AddrFrom16(b).Unmap()
	}
	return netip.AddrFrom16(b)
}

func lastAddr(p netip.Prefix) netip.Addr {
	a := p.Masked().Addr()
	b := a.As16()
	start := p.Bits()
	if a.Is4() {
		start += 96
	}
	for i := start; i < 128; i++ {
		b[i/8] |= 0x80 >> (i % 8)
	}
	if a.Is4() {
		return netip.AddrFrom16(b).Unmap()
	}
	return netip.AddrFrom16(b)
}

func randRule(rng *rand.Rand) Rule {
	v6 := rng.IntN(2) == 0
	addr := clusterAddr(rng, v6)
	bits := addr.BitLen() - rng.IntN(13)
	if rng.IntN(15) == 0 {
		bits = rng.IntN(9)
	}
	r := Rule{CIDR: netip.PrefixFrom(addr, bits).Masked()}
	for range rng.IntN(4) {
		host := addr.BitLen() - bits
		inside := withLow(r.CIDR.Addr(), rng.IntN(1<<min(host, 10)))
		r.Except = append(r.Except, netip.PrefixFrom(inside, bits+rng.IntN(host+1)).Masked())
	}
	for range rng.IntN(4) {
		pr := PortRange{Protocol: []Protocol{ProtocolTCP, ProtocolUDP, ProtocolSCTP}[rng.IntN(3)], Last: 65535}
		if rng.IntN(4) > 0 {
			pr.First = uint16(1 + rng.IntN(20))
			pr.Last = pr.First + uint16(rng.IntN(5))
		}
		r.Ports = append(r.Ports, pr)
	}
	if len(r.Ports) == 0 {
		r.Ports = []PortRange{allPorts}
	}
	return r
}

func ExampleDirectionPolicy_Compile() {
	d := DirectionPolicy{Isolated: true, Rules: []Rule{
		{CIDR: pfx("10.1.0.0/16"), Except: []netip.Prefix{pfx("10.1.5.0/24")}, Ports: []PortRange{tcp(80, 90)}},
		{CIDR: pfx("10.0.0.0/8"), Ports: []PortRange{udp(53, 53)}},
	}}
	v4, _, _ := d.Compile()
	for _, e := range v4 {
		fmt.Println(e.Prefix, e.Ports)
	}
	// Output:
	// 10.0.0.0/8 [UDP/53]
	// 10.1.0.0/16 [TCP/80-90 UDP/53]
	// 10.1.5.0/24 [UDP/53]
}

// TestCheckPortSets: Check counts the distinct lists of more than
// InlinePortRanges ranges, across prefixes, families and directions, and
// refuses a set with more than MaxPortSets of them; short lists and lists
// repeated under other prefixes do not count.
func TestCheckPortSets(t *testing.T) {
	policyWith := func(lists int, extra ...Rule) Set {
		var rules []Rule
		for i := range lists {
			// A distinct list of three ranges per /32, half of them IPv6.
			cidr := netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)}), 32)
			if i%2 == 1 {
				cidr = netip.PrefixFrom(netip.AddrFrom16([16]byte{0: 0xfd, 14: byte(i >> 8), 15: byte(i)}), 128)
			}
			p := uint16(6 * i) // not adjacent, or Compile merges them
			rules = append(rules, Rule{CIDR: cidr, Ports: []PortRange{tcp(p, p), tcp(p+2, p+2), tcp(p+4, p+4)}})
		}
		rules = append(rules, extra...)
		return Set{Sources: []string{"p.yaml#0"}, Ingress: DirectionPolicy{Isolated: true, Rules: rules}}
	}
	short := make([]Rule, 0, 600)
	for i := range 600 { // distinct, but short enough to stay in their entries
		short = append(short, Rule{CIDR: pfx(fmt.Sprintf("10.9.%d.%d/32", i/256, i%256)), Ports: []PortRange{tcp(uint16(i), uint16(i)), udp(53, 53)}})
	}
	s := policyWith(MaxPortSets, short...)
	if err := s.Check(); err != nil {
		t.Fatalf("%d port sets and 600 short lists: %v", MaxPortSets, err)
	}
	// The same lists again, for egress: still MaxPortSets distinct ones.
	s.Egress = s.Ingress
	if err := s.Check(); err != nil {
		t.Fatalf("%d port sets used by both directions: %v", MaxPortSets, err)
	}
	s = policyWith(MaxPortSets + 1)
	err := s.Check()
	if !errors.Is(err, ErrTooManyPortSets) || !strings.Contains(err.Error(), "p.yaml#0") || !strings.Contains(err.Error(), "513 distinct lists") {
		t.Fatalf("%d port sets: error %v, want ErrTooManyPortSets naming p.yaml#0 and the count", MaxPortSets+1, err)
	}
}

// TestCheckEntries: Check refuses a direction that compiles to more than
// MaxEntries entries of one family, and counts the families apart.
func TestCheckEntries(t *testing.T) {
	hosts := func(n int, v6 bool) []Rule {
		var rs []Rule
		for i := range n {
			a := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
			if v6 {
				a = netip.AddrFrom16([16]byte{0: 0xfd, 13: byte(i >> 16), 14: byte(i >> 8), 15: byte(i)})
			}
			rs = append(rs, Rule{CIDR: netip.PrefixFrom(a, a.BitLen()), Ports: []PortRange{tcp(80, 80)}})
		}
		return rs
	}
	full := Set{Sources: []string{"big.yaml#0"}, Egress: DirectionPolicy{Isolated: true,
		Rules: append(hosts(MaxEntries, false), hosts(MaxEntries, true)...)}}
	if err := full.Check(); err != nil {
		t.Fatalf("%d prefixes of each family: %v", MaxEntries, err)
	}
	over := Set{Sources: []string{"big.yaml#0"}, Egress: DirectionPolicy{Isolated: true, Rules: hosts(MaxEntries+1, true)}}
	err := over.Check()
	if !errors.Is(err, ErrTooManyEntries) || !strings.Contains(err.Error(), "big.yaml#0") || !strings.Contains(err.Error(), "8065 prefixes") {
		t.Fatalf("%d IPv6 prefixes: error %v, want ErrTooManyEntries naming big.yaml#0 and the count", MaxEntries+1, err)
	}
}
