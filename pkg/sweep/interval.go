package sweep

import "time"

// Interval bounds the time between full passes.
type Interval struct {
	Min, Max time.Duration
}

// DefaultInterval: a pass over a full map of the default size takes tens
// of milliseconds, so a minute's wait is a guess about churn, not a cost.
var DefaultInterval = Interval{Min: 10 * time.Second, Max: 5 * time.Minute}

// Next is the wait after a pass that left the maps at fill (their fuller
// one's occupancy, 0 to 1) and deleted deleted of scanned entries, after a
// wait of last. As Cilium's conntrack GC does, the interval shrinks while
// passes find much to delete, or the maps fill up (an LRU map that is full
// evicts live flows to make room), and grows while they find little.
func (iv Interval) Next(last time.Duration, fill float64, deleted, scanned int) time.Duration {
	ratio := 0.0
	if scanned > 0 {
		ratio = float64(deleted) / float64(scanned)
	}
	next := last
	switch {
	case fill >= 0.9 || ratio >= 0.25:
		next = last / 2
	case ratio >= 0.05:
		// About right.
	default:
		next = last * 3 / 2
	}
	return min(max(next, iv.Min), iv.Max)
}
