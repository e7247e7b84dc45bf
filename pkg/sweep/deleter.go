package sweep

import (
	"sync"

	"github.com/podfence/podfence/bpf"
)

// deleter deletes a pass's dead entries beside its scan: the kernel's work
// for one batch's deletes overlaps the next batch's read and decisions,
// on a second CPU where the node gives one. The pass waits for it before
// it returns, so no delete outlives the pass that decided it.
type deleter struct {
	g    *bpf.Global
	work chan []bpf.CTEntry
	free chan []bpf.CTEntry // batches to fill: two in flight, one filling
	done chan struct{}

	mu      sync.Mutex
	deleted int
	err     error
}

func newDeleter(g *bpf.Global) *deleter {
	d := &deleter{g: g, work: make(chan []bpf.CTEntry, 2), free: make(chan []bpf.CTEntry, 3), done: make(chan struct{})}
	for range 3 {
		d.free <- make([]bpf.CTEntry, 0, bpf.CTBatch)
	}
	go d.run()
	return d
}

func (d *deleter) run() {
	defer close(d.done)
	for batch := range d.work {
		if d.failed() == nil {
			n, err := d.g.DeleteConntrack(batch)
			d.mu.Lock()
			d.deleted += n
			if err != nil {
				d.err = err
			}
			d.mu.Unlock()
		}
		d.free <- batch[:0]
	}
}

// batch returns an empty batch to fill and hand to delete.
func (d *deleter) batch() []bpf.CTEntry { return <-d.free }

// delete queues a filled batch.
func (d *deleter) delete(batch []bpf.CTEntry) { d.work <- batch }

// failed is the first delete's error, if one failed: the scan stops.
func (d *deleter) failed() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.err
}

// wait finishes the queued deletes and returns how many entries went.
func (d *deleter) wait() (int, error) {
	close(d.work)
	<-d.done
	return d.deleted, d.err
}
