package bpf

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/pkg/policy"
)

// trialCTEntries is the capacity of a trial's scratch conntrack maps: the
// entries of the one pod it runs for.
const trialCTEntries = 4096

// skbContext is the start of struct __sk_buff up to ifindex, the only field
// a trial sets: the kernel takes a shorter context and zero-fills the rest.
type skbContext struct {
	_       [10]uint32 // len ... ingress_ifindex
	Ifindex uint32
}

// Trial runs frame through a fresh instance of the identifier's program for
// direction d, as if it had arrived on the host veth ifindex, and reports
// the verdict and the reason. The instance is loaded from the same object
// as the attached programs and reads the identifier's live policy, state
// and the node's addresses, but every map the datapath writes is a scratch
// copy: conntrack holds a copy of the pod's live entries (so an
// established flow answers as it would), and the counters, deny events,
// fragment and clock caches are empty. Nothing on the node changes.
func (i *Datapath) Trial(d policy.Direction, frame []byte, ifindex uint32) (uint32, Reason, error) {
	cs, err := loadableSpec()
	if err != nil {
		return 0, 0, err
	}
	repl := map[string]*ebpf.Map{mapNodeAddrs: i.global.NodeAddrs}
	for name, m := range i.mapFields() {
		repl[name] = *m
	}
	var scratch []*ebpf.Map
	defer func() { closeAll(scratch...) }()
	for _, name := range []string{mapCTv4, mapCTv6, mapDenyEvents, mapEventBudget, mapFrags, mapTickClock, mapCounters} {
		ms := cs.Maps[name].Copy()
		ms.Pinning = ebpf.PinNone
		if name == mapCTv4 || name == mapCTv6 {
			ms.MaxEntries = trialCTEntries
		}
		m, err := ebpf.NewMap(ms)
		if err != nil {
			return 0, 0, fmt.Errorf("trial: scratch map %s: %w", name, err)
		}
		scratch = append(scratch, m)
		repl[name] = m
	}
	if err := i.global.copyConntrack(repl[mapCTv4], repl[mapCTv6], ifindex); err != nil {
		return 0, 0, err
	}
	name := progIngress
	if d == policy.Egress {
		name = progEgress
	}
	prog, err := loadProgram(cs, name, repl)
	if err != nil {
		return 0, 0, err
	}
	defer prog.Close()
	ret, err := prog.Run(&ebpf.RunOptions{Data: frame, Context: skbContext{Ifindex: ifindex}})
	if err != nil {
		return 0, 0, fmt.Errorf("trial run: %w", err)
	}
	c, err := readCounters(repl[mapCounters])
	if err != nil {
		return 0, 0, err
	}
	for r := range NumReasons {
		if c[d][r] != 0 {
			return ret, r, nil
		}
	}
	return ret, 0, errors.New("trial run: no reason counted")
}

// copyConntrack puts the live entries of the pod behind ifindex into v4 and
// v6. A pod with more than trialCTEntries flows keeps its most recent
// ones in the LRU copy, which is enough for any one packet's lookup as long
// as its flow is among them.
func (g *Global) copyConntrack(v4, v6 *ebpf.Map, ifindex uint32) error {
	return g.ScanConntrack(func(batch []CTEntry) error {
		for i := range batch {
			e := &batch[i]
			if e.Ifindex != ifindex {
				continue
			}
			var err error
			if e.Key.Family == 4 {
				k := e.keyV4()
				err = v4.Put(&k, &e.Value)
			} else {
				k := e.keyV6()
				err = v6.Put(&k, &e.Value)
			}
			if err != nil {
				return fmt.Errorf("trial: copy conntrack: %w", err)
			}
		}
		return nil
	})
}
