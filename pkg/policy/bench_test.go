package policy

import (
	"fmt"
	"net/netip"
	"testing"
)

// BenchmarkCompile compiles one direction that lists n hosts, the shape of
// a policy generated from a large address list; the plugin compiles a
// pod's policy on every ADD.
func BenchmarkCompile(b *testing.B) {
	for _, n := range []int{100, MaxEntries} {
		b.Run(fmt.Sprintf("%d-hosts", n), func(b *testing.B) {
			var rs []Rule
			for i := range n {
				a := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
				rs = append(rs, Rule{CIDR: netip.PrefixFrom(a, 32), Ports: []PortRange{tcp(80, 80)}},
					Rule{CIDR: netip.PrefixFrom(a, 24), Except: []netip.Prefix{netip.PrefixFrom(a, 32)}})
			}
			d := DirectionPolicy{Isolated: true, Rules: rs}
			for b.Loop() {
				if _, _, err := d.Compile(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
