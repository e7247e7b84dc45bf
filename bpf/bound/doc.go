// Package bound holds the lower bound of the datapath's cost: two eBPF
// programs that parse a packet and do no more than the map operations
// DESIGN.md prescribes for it, on podfence's own map definitions and clock.
// A conntrack hit is one lookup of the conntrack key, the generation check
// and the refresh of last_seen; an allowed new flow is one trie lookup and
// one conntrack insert. The rest price ways of judging a pod's egress after
// Service translation (BenchmarkEgressAfterNAT) and show the kernel does
// what the chosen one needs (TestAfterNATFacilities); LoadCopy loads one
// copy per pod for them.
//
// It is not part of podfence: BenchmarkLowerBound (package bpf) runs it
// beside BenchmarkDatapath, so that a reader can tell the cost of
// podfence's own logic from the cost of the maps the design prescribes.
package bound
