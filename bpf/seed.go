package bpf

import (
	"fmt"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/pkg/policy"
)

// Seed runs frame, a connection's opening packet, through the identifier's
// program for direction d as if it had arrived on the host veth ifindex,
// on the live maps: an allowed flow gets the conntrack entry the datapath
// writes for a new one, marked with the direction that opened it; a
// denied one is counted and reported like any denied packet. It is how
// flows that were open before the pod's programs were attached (an
// adopted pod's) are judged as they were opened, not by the direction of
// whichever packet comes next. Unlike Trial, it changes the node.
func (i *Datapath) Seed(d policy.Direction, frame []byte, ifindex uint32) (uint32, error) {
	prog := i.Ingress
	if d == policy.Egress {
		prog = i.Egress
	}
	ret, err := prog.Run(&ebpf.RunOptions{Data: frame, Context: skbContext{Ifindex: ifindex}})
	if err != nil {
		return 0, fmt.Errorf("seed %s flow: %w", d, err)
	}
	return ret, nil
}
