// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
// Types shared by the datapath and, through bpf2go, by the Go loader. Every
// layout change here is a map incompatibility: the loader then refuses the
// old pins instead of silently reusing them (see bpf/loader.go).
#pragma once

#include <linux/types.h>

// Port ranges one port set holds; the policy compiler refuses more for a prefix.
#ifndef MAX_PORT_RANGES
#define MAX_PORT_RANGES 64
#endif

enum direction {
	DIR_INGRESS = 0, // traffic to the pod: runs at the host veth's TC egress
	DIR_EGRESS = 1,  // traffic from the pod: runs at the host veth's TC ingress
};

// Why a packet got its verdict; index into the per-identifier counters
// (counter index = direction * REASON_MAX + reason) and part of deny events.
enum reason {
	REASON_CT_ESTABLISHED = 0, // conntrack hit in the flow's own direction
	REASON_CT_REPLY = 1,       // conntrack hit of the reversed tuple
	REASON_POLICY_ALLOW = 2,   // new flow allowed by a rule
	REASON_NOT_ISOLATED = 3,   // new flow in a direction no policy isolates
	REASON_NODE = 4,           // new flow from one of the node's addresses
	REASON_NOT_IP = 5,         // not IPv4/IPv6 (ARP, LLDP): passed
	REASON_POLICY_DENY = 6,    // new flow no rule allows
	REASON_REVOKED = 7,        // tracked flow the current policy no longer allows
	REASON_MALFORMED = 8,      // truncated or malformed IP packet: dropped
	REASON_CT_RELATED = 9,     // ICMP error about a tracked flow (e.g. "packet too big")
	REASON_ND = 10,            // IPv6 link control (neighbour discovery, MLD): passed like ARP
	REASON_SPOOFED = 11,       // from the pod, with a source that is not the pod's: dropped
	REASON_ADMIN_ACCEPT = 12,  // new flow an Admin tier rule accepts
	REASON_ADMIN_DENY = 13,    // new flow an Admin tier rule denies
	REASON_BASELINE_ACCEPT = 14, // new flow a Baseline tier rule accepts
	REASON_BASELINE_DENY = 15,   // new flow a Baseline tier rule denies
	// A new or tracked flow to a Service whose translation the kernel's
	// conntrack did not give (no entry, no judge in the slot, a protocol
	// the lookup does not cover): dropped, since it cannot be judged.
	REASON_UNTRANSLATED = 16,
	REASON_MAX = 17,
};

// Bits of id_state.enforced: what judges a new flow in direction d, each
// shifted left by d, and consulted in this order (see judge in podfence.c).
// A direction with none of its bits set allows every new flow.
enum enforced_bits {
	ENFORCE_ADMIN = 1 << 2,        // Admin tier rules: the tiers trie
	ENFORCE_POLICY = 1 << 0,       // NetworkPolicy isolates d: the pol_* tries decide
	ENFORCE_BASELINE = 1 << 4,     // Baseline tier rules: the tiers trie
	ENFORCE_DEFAULT_DENY = 1 << 6, // strict mode's default, behind Baseline: only the node passes
};

// Every bit of direction 0; shifted by d, every bit of d.
#define ENFORCE_ANY (ENFORCE_ADMIN | ENFORCE_POLICY | ENFORCE_BASELINE | ENFORCE_DEFAULT_DENY)

// State of one identifier (array map with one entry).
// The policy has two sides, each a full copy of the maps that judge a new
// flow (the tries pol_* and tiers, suffixed _1 on side 1) with its own
// enforced bits; the generation's parity selects the side in force.
// ApplyPolicy writes the other side, then bumps the generation: one write
// moves every layer to the new policy at once (policy.go).
struct id_state {
	__u32 generation; // bumped by every policy change; stale conntrack entries are re-checked
	__u8 mode;        // 0 standard, 1 strict (informational: enforced already encodes it)
	// enum enforced_bits of side 0, per direction. Bits 0 and 1
	// (ENFORCE_POLICY) were all there was before layout 3, with the same
	// meaning; before layout 4 there was only this side.
	__u8 enforced;
	__u8 applying;   // set while ApplyPolicy changes the policy (the datapath ignores it)
	__u8 enforced_1; // side 1's (padding before layout 4)
};

// One allowed port range. proto 0 matches every protocol.
struct port_range {
	__u8 proto;
	__u8 pad;
	__u16 first; // host byte order
	__u16 last;  // inclusive
};

enum policy_flags {
	POLICY_NODE = 1, // the key is one of the node's addresses: everything is allowed
};

// Port ranges a policy entry holds itself; more go to a port set.
#define POLICY_INLINE_RANGES 2

// Value of a policy LPM entry: what is allowed for addresses whose longest
// matching prefix is the key. A trie node holds its key and value together,
// the kernel sizes every node for the largest value, and a lookup walks
// about ten nodes: so the value is small, and an entry with more ranges
// than it holds names a port set, which every entry allowing the same
// ranges shares. count 0 allows nothing.
struct policy_value {
	__u16 flags; // enum policy_flags
	__u16 count; // ranges allowed: in ranges up to POLICY_INLINE_RANGES, else in the port set
	__u32 ports; // key of the port set in port_sets when count > POLICY_INLINE_RANGES
	struct port_range ranges[POLICY_INLINE_RANGES];
};

// Allowed port ranges of entries that have more than POLICY_INLINE_RANGES.
struct port_set {
	__u16 count;
	__u16 pad;
	struct port_range ranges[MAX_PORT_RANGES];
};

// Cluster policy tiers: one trie per identifier holds the Admin and
// Baseline rules of both directions and families, told apart by the key's
// first byte, so that an identifier has one more map, not eight.
enum tier_sel {
	TIER_SEL_BASELINE = 1, // else Admin
	TIER_SEL_EGRESS = 2,   // else ingress
	TIER_SEL_IPV6 = 4,     // else IPv4 (4 address bytes, then zeros)
};

struct tier_key {
	__u32 prefixlen; // 8 (sel) + the address prefix length
	__u8 sel;        // enum tier_sel
	__u8 addr[16];
	__u8 pad[3]; // beyond every prefix: never compared
};

// What a tier slot does with a flow it matches (policy.Action, plus one).
enum tier_action {
	TIER_NO_MATCH = 0, // tier_lookup's answer when no slot matches
	TIER_DENY = 1,
	TIER_ACCEPT = 2,
	TIER_PASS = 3, // the rest of the tier is skipped
	TIER_NODE = 4, // tier_lookup's answer for an entry of the node's addresses
};

// Slots one tier entry holds: policy.MaxTierRules.
#define MAX_TIER_SLOTS 24

// One rule, or rules of one priority and action merged, of a tier entry.
struct tier_slot {
	__u8 action;    // enum tier_action
	__u8 count;     // port ranges: 1 in range, more in the port set ports
	__u16 priority; // for inspection only: the slots are already in order
	__u32 ports;    // key in port_sets when count > 1
	struct port_range range;
	__u16 pad;
};

enum tier_flags {
	TIER_ENTRY_NODE = 1, // the key is one of the node's addresses: allowed before any rule
};

// Value of a tiers entry: the slots, in evaluation order, of the rules
// whose CIDR holds every address of the key's prefix. The first slot whose
// ports hold the flow's decides, whatever the prefix length of its rule:
// the compiler (policy.TierRules.Compile) has put every rule that covers
// the prefix into it, so priority, not prefix length, orders them.
struct tier_value {
	__u8 count; // slots used
	__u8 flags; // enum tier_flags
	__u16 pad;
	struct tier_slot slots[MAX_TIER_SLOTS];
};

struct lpm_key_v4 {
	__u32 prefixlen;
	__u8 addr[4];
};

struct lpm_key_v6 {
	__u32 prefixlen;
	__u8 addr[16];
};

// Addresses one pod's host veth may send from; more are refused at ADD.
#define MAX_POD_ADDRS 8

enum source_flags {
	SOURCES_ANY = 1, // the check is off for this pod (the plugin's sourceCheck false)
};

// The source addresses of the pod behind one host veth, keyed by the veth's
// ifindex in its identifier's sources map. Exact addresses (the pod's /32
// and /128, never the primary plugin's prefix), IPv4 as IPv4-mapped IPv6.
struct pod_sources {
	__u8 count; // addresses in addrs
	__u8 flags; // enum source_flags
	__u8 pad[6];
	__u8 addrs[MAX_POD_ADDRS][16];
};

// Conntrack keys, written from the pod's side so that a flow and its replies
// share one key: src is the pod, which is also the entry's owner (the pod
// that enforces it; no separate field needed), dst the peer, sport/dport
// their ports. Addresses in network order, ports in host
// order; ifindex is the pod's host veth. ICMP echo uses the identifier as
// both ports. flags in the value say which side opened the flow.
struct ct_key_v4 {
	__u8 src[4];
	__u8 dst[4];
	__u32 ifindex;
	__u16 sport;
	__u16 dport;
	__u8 proto;
	__u8 pad[3];
};

struct ct_key_v6 {
	__u8 src[16];
	__u8 dst[16];
	__u32 ifindex;
	__u16 sport;
	__u16 dport;
	__u8 proto;
	__u8 pad[3];
};

enum ct_flags {
	CT_EGRESS = 1, // the pod opened the flow (else the peer did)
	CT_NODE = 2,   // allowed because the peer is the node itself
	// Opened to a Service frontend and judged on its backend after the
	// translation (pod_after_nat): dst is the frontend, as the veth sees
	// the flow, and a stale entry is judged again on the backend that
	// the kernel's conntrack entry names.
	CT_SERVICE = 4,
	// Opened to a frontend that the kernel did not translate for it (a
	// socket of the node bound to the frontend, behind a notrack rule):
	// judged on the frontend, like a flow to anything else.
	CT_DIRECT = 8,
};

struct ct_value {
	__u64 last_seen_ns; // bpf_ktime_get_ns (CLOCK_MONOTONIC) of the last packet
	__u32 generation;   // id_state.generation the flow was last checked against
	__u8 flags;         // enum ct_flags
	__u8 pad[3];
};

// A Service frontend that kube-proxy translates on this node (a ClusterIP,
// an external or load-balancer IP, a node address with a NodePort): an
// egress flow to it is judged on its backend, after the translation. The
// address is IPv6 or IPv4-mapped (as in node_addrs), the port in host order.
struct service_key {
	__u8 addr[16];
	__u16 port;
	__u8 proto;
	__u8 pad;
};

// Key of the datagrams whose first fragment was seen: what identifies a
// datagram (RFC 791, RFC 8200) with IPv4 addresses in the first 4 bytes.
struct frag_key {
	__u8 src[16];
	__u8 dst[16];
	__u32 id; // IPv4 identification (16 bits) or IPv6 fragment identification
	__u8 proto;
	__u8 family;
	__u8 pad[2];
};

// The ports a datagram's first fragment carried, for its later fragments.
struct frag_ports {
	__u16 sport;
	__u16 dport;
};

// A denied packet, as the sweeper's trace command reads it from the ring buffer.
struct deny_event {
	__u64 timestamp_ns;
	__u32 ifindex;
	__u8 family; // 4 or 6
	__u8 proto;
	__u8 direction;
	__u8 reason;
	__u16 sport;
	__u16 dport;
	__u8 src[16]; // IPv4 in the first four bytes
	__u8 dst[16];
};

// Per-CPU token bucket that rate-limits deny events.
struct event_budget {
	__u64 last_ns;
	__u64 tokens;
	// Deny events not written: no token left, or the ring buffer full.
	__u64 dropped;
};

// Per-CPU cache of the clock: the conntrack time of the current jiffy.
struct cached_time {
	__u64 jiffies; // bpf_jiffies64 when ns was read
	__u64 ns;      // CLOCK_MONOTONIC ns read in that jiffy; 0 before the first read
};
