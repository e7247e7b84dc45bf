// Package ctnetlink reads the kernel's connection tracking table over
// netlink (NETLINK_NETFILTER, the ctnetlink subsystem): a dump of every
// flow, and the stream of destroy events.
//
// It decodes only what the sweeper compares, the original and reply tuples
// of IPv4 and IPv6 flows, and decodes them into a caller-owned value without
// allocating, because a node's table holds hundreds of thousands of flows
// and a pass reads all of them. For the rest of a flow (status, timeouts,
// counters, labels) use github.com/ti-mo/conntrack.
//
// Sockets belong to the network namespace of the thread that opens them.
// Both need CAP_NET_ADMIN in that namespace. Destroy events need
// net.netfilter.nf_conntrack_events at 1, or at its default 2, where the
// kernel sends them only for flows created while someone listened: a flow
// older than the subscription is destroyed silently, and only a dump finds
// that it is gone.
package ctnetlink
