package attach

import (
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/podfence/podfence/test/kernel"
	"github.com/podfence/podfence/test/netnsutil"
)

// BenchmarkAttach measures one hook's Attach and Detach on a live veth, per
// mode, as the plugin's ADD and DEL make them (a TCX link is also pinned and
// unpinned). It reports the median of each, in milliseconds.
//
// A TCX attach or detach swaps the device's program array and then waits
// for an RCU grace period while holding RTNL (tcx_entry_sync in
// include/net/tcx.h, since Linux 6.6), so its cost is the kernel's grace
// period rather than podfence's work; cls_bpf changes its filter chain
// without waiting. Another veth keeps programs on both hooks throughout, as
// the other pods of a node do, so that the kernel's static keys for the
// hooks never flip back to off between iterations.
func BenchmarkAttach(b *testing.B) {
	for _, m := range modes {
		b.Run(string(m), func(b *testing.B) {
			requireMode(b, m)
			prog := passProgram(b)
			root := kernel.PinRoot(b)
			other := netnsutil.NewPair(b)
			for _, h := range []Hook{HookIngress, HookEgress} {
				o := Options{Ifindex: other.HostIndex, Hook: h, Program: prog, Mode: m, LinkPin: filepath.Join(root, "other_"+h.String())}
				netnsutil.Do(b, other.Node, func() error { _, err := Attach(o); return err })
				b.Cleanup(func() { netnsutil.Do(b, other.Node, func() error { return Detach(o) }) })
			}
			pair := netnsutil.NewPair(b)
			o := Options{
				Ifindex: pair.HostIndex,
				Hook:    HookIngress,
				Program: prog,
				Mode:    m,
				LinkPin: filepath.Join(root, "link"),
			}
			var att, det []time.Duration
			for b.Loop() {
				netnsutil.Do(b, pair.Node, func() error {
					start := time.Now()
					if _, err := Attach(o); err != nil {
						return err
					}
					mid := time.Now()
					if err := Detach(o); err != nil {
						return err
					}
					att, det = append(att, mid.Sub(start)), append(det, time.Since(mid))
					return nil
				})
			}
			b.ReportMetric(medianMs(att), "attach-ms")
			b.ReportMetric(medianMs(det), "detach-ms")
		})
	}
}

func medianMs(d []time.Duration) float64 {
	slices.Sort(d)
	return float64(d[len(d)/2].Microseconds()) / 1000
}
