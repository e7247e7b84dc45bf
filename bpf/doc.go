// Package bpf is podfence's datapath: the TC programs in podfence.c (one
// ingress and one egress program, each handling IPv4 and IPv6; a judge of
// Service flows after their translation, and the uplinks' program that
// reaches it, service.h), their bpf2go output, and the loader that shares
// them through bpffs.
//
// Objects live below a pin root (default /sys/fs/bpf/podfence):
//
//	global/           conntrack maps (v4, v6), the node's addresses, the deny
//	                  event ring buffer and its per-CPU rate limiter, the
//	                  ports of fragmented datagrams, the per-CPU clock cache,
//	                  the Service frontends (services.go), the identifiers'
//	                  judges by slot and the slots' reservations (slots.go)
//	ids/<identifier>/ its programs, the state map (policy generation and
//	                  isolation), per-CPU verdict counters, two sides of the
//	                  policy (four policy tries and a tiers trie each, _1
//	                  on side 1), the port sets their entries name, and
//	                  each member's source addresses
//
// OpenGlobal and OpenIdentifier reuse compatible pins and refuse
// incompatible ones (ErrIncompatiblePin) rather than swapping them, because
// replicas attached to the old objects would stop sharing state. Pins of an
// earlier layout or build are taken over on purpose: OpenGlobal for the
// node's maps, RenewIdentifier for an identifier's, whose caller then moves
// the members onto the new programs (renew.go, package pinroot); each
// directory of maps records its LayoutVersion (version.go). ApplyPolicy
// writes a compiled policy.Set to the side not in force and bumps the
// generation, which puts it in force whole and makes every tracked flow be
// re-checked on its next packet. Callers serialise work on
// one identifier (the CNI plugin holds its lock).
//
// Requires Linux 5.10: ring buffer (5.8), global functions with scalar
// arguments (5.6), bpf_jiffies64 (5.6), bounded loops (5.3). Where
// bpf_ktime_get_coarse_ns exists (5.11) conntrack timestamps use it; where
// the conntrack kfuncs exist (5.18) Services are judged on their backends
// (AfterNATSupported). Attaching (TCX from 6.6, clsact and cls_bpf before)
// is package attach's job.
package bpf
