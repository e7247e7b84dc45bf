package e2e

import (
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/podfence/podfence/test/builds"
	"github.com/podfence/podfence/test/kernel"
)

// BenchmarkUpgrade measures the next layout's `podfence-sweeper upgrade` on
// a node of 20 identifiers of 5 members each, which this build added:
// every identifier gets new tries (entries copied) and programs, and every
// member's two hooks are swapped. An identifier's floor is loading its two
// programs, which its first ADD did too: the ratio is the upgrade's time
// per identifier to the median of those ADDs, measured in the same run.
// Run it with -benchtime=1x (hack/bench.sh does).
func BenchmarkUpgrade(b *testing.B) {
	kernel.RequireRoot(b)
	next := builds.NextLayout(b)
	for _, mode := range attachModes(b) {
		b.Run(mode, func(b *testing.B) {
			for range b.N {
				benchUpgrade(b, mode, next)
			}
		})
	}
}

func benchUpgrade(b *testing.B, mode, next string) {
	const identifiers, members = 20, 5
	c := newCluster(b, mode)
	c.writePolicy("apps", selectPolicy("app0-7f65cc6544-x2k4b"))
	slots := c.newSlots(identifiers * members)
	var first []time.Duration
	for i := range identifiers {
		for j := range members {
			pod := fmt.Sprintf("app%d-7f65cc6544-x2k4%c", i, "bcdfg"[j])
			d, err := c.timedExec(invocation{command: "ADD", containerID: fmt.Sprintf("ctr-%d-%d", i, j), pod: pod, slot: slots[i*members+j]})
			if err != nil {
				b.Fatal(err)
			}
			if j == 0 {
				first = append(first, d)
			}
		}
	}
	c.useBuild(next)
	start := time.Now()
	out, err := c.sweeper(b, "upgrade", "--json", "--pin-root", c.pinRoot)
	took := time.Since(start)
	if err != nil {
		b.Fatal(err)
	}
	var rep upgradeOutput
	if err := json.Unmarshal(out, &rep); err != nil {
		b.Fatalf("upgrade output: %v: %s", err, out)
	}
	if len(rep.Identifiers) != identifiers {
		b.Fatalf("upgraded %d identifiers, want %d: %s", len(rep.Identifiers), identifiers, out)
	}
	for _, u := range rep.Identifiers {
		if !u.Programs || u.Moved != members || len(u.Maps) != 4 {
			b.Fatalf("identifier %s: %+v, want new programs and tries and %d members moved", u.ID, u, members)
		}
	}
	slices.Sort(first)
	perID := took / identifiers
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	b.ReportMetric(ms(took), "upgrade-ms")
	b.ReportMetric(ms(perID), "per-identifier-ms")
	b.ReportMetric(ms(first[len(first)/2]), "first-add-p50-ms")
	b.ReportMetric(float64(perID)/float64(first[len(first)/2]), "per-identifier/first-add")
}

// upgradeOutput is what `upgrade --json` prints.
type upgradeOutput struct {
	Layout      uint32
	Identifiers []struct {
		ID       string `json:"identifier"`
		From     uint32
		Maps     []string
		Programs bool
		Moved    int
	}
}
