// Package bound holds the lower bound of the datapath's cost: two eBPF
// programs that do only what any datapath with DESIGN.md's maps must do for
// a packet, on podfence's own map types and sizes. A conntrack hit is one
// parse and one lookup of the conntrack key; an allowed new flow is one
// parse, one trie lookup and one conntrack insert.
//
// It is not part of podfence: BenchmarkLowerBound (package bpf) runs it
// beside BenchmarkDatapath, so that a reader can tell the cost of
// podfence's own logic from the cost of the maps the design prescribes.
package bound
