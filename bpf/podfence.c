//go:build ignore
// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//
// podfence datapath: one ingress and one egress TC program per pod
// identifier, both handling IPv4 and IPv6. The pod's egress program runs at
// its host veth's TC ingress, its ingress program at TC egress.
//
// Per packet: conntrack hit (forward or reversed tuple) with the current
// policy generation allows; a stale generation re-checks the flow; an ICMP
// error about a tracked flow is allowed as related; anything else is
// judged by the layers the identifier's state enforces (the Admin tier,
// NetworkPolicy's tries, the Baseline tier, strict mode's default; see
// judge) and, when allowed, tracked.
// Allow returns TC_ACT_UNSPEC (TCX_NEXT) so later TC programs still run.

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#include "types.h"
#include "maps.h"
#include "clock.h"
#include "parse.h"
#include "calls.h"
#include "service.h"

char __license[] SEC("license") = "Dual BSD/GPL";

#define VERDICT_ALLOW TC_ACT_UNSPEC
#define VERDICT_DROP TC_ACT_SHOT

// Deny events: one per 2^EVENT_INTERVAL_SHIFT ns (about 1 ms) per CPU on
// average, in bursts of at most EVENT_BURST. A shift, not a division: a
// division costs more than the rest of the rate limiter.
#define EVENT_INTERVAL_SHIFT 20
#define EVENT_BURST 64

// ---- Global maps, pinned once per node and shared by every identifier ----

CT_MAP(ct_v4, struct ct_key_v4, CT_V4_ENTRIES);
CT_MAP(ct_v6, struct ct_key_v6, CT_V6_ENTRIES);

// Ports of fragmented datagrams, recorded from each first fragment so that
// the later ones, which carry no transport header, are judged with them.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 8192);
	__type(key, struct frag_key);
	__type(value, struct frag_ports);
} frags SEC(".maps");

// The node's own addresses (IPv4 as IPv4-mapped IPv6), from which kubelet
// probes come. The programs do not read it: the loader copies these
// addresses into every identifier's ingress tries (POLICY_NODE entries), so
// a new flow costs one lookup, not two. It is pinned here so that every
// process programming tries sees the same set.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 256);
	__type(key, __u8[16]);
	__type(value, __u8);
} node_addrs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
} deny_events SEC(".maps");

// Only a local variable has struct deny_event's type, and clang keeps no
// BTF for locals: this constant puts it in the object so that bpf2go
// generates the Go type the sweeper decodes events with.
const struct deny_event *const deny_event_type = 0;

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct event_budget);
} event_budget SEC(".maps");

// ---- Per-identifier maps, pinned per identifier and shared by its replicas ----

STATE_MAP(state);

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 2 * REASON_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

// The Admin and Baseline rules of both directions and families (struct
// tier_key), and the node's addresses among the ingress ones.
// Each of these, and the policy tries below, exists once per side (struct
// id_state): the maps are named directly, not through an array of maps,
// so that a lookup costs what it did with one side.
#define TIER_TRIE(name)                                                                            \
	struct {                                                                                   \
		__uint(type, BPF_MAP_TYPE_LPM_TRIE);                                               \
		__uint(map_flags, BPF_F_NO_PREALLOC);                                              \
		__uint(max_entries, TIER_TRIE_ENTRIES);                                            \
		__type(key, struct tier_key);                                                      \
		__type(value, struct tier_value);                                                  \
	} name SEC(".maps")

TIER_TRIE(tiers);
TIER_TRIE(tiers_1);

POLICY_TRIE(pol_in_v4, struct lpm_key_v4);
POLICY_TRIE(pol_in_v6, struct lpm_key_v6);
POLICY_TRIE(pol_eg_v4, struct lpm_key_v4);
POLICY_TRIE(pol_eg_v6, struct lpm_key_v6);
POLICY_TRIE(pol_in_v4_1, struct lpm_key_v4);
POLICY_TRIE(pol_in_v6_1, struct lpm_key_v6);
POLICY_TRIE(pol_eg_v4_1, struct lpm_key_v4);
POLICY_TRIE(pol_eg_v6_1, struct lpm_key_v6);

// The port sets of trie entries with many ranges (struct policy_value.ports):
// twice policy.MaxPortSets, so that a policy's sets and those of the policy
// replacing it fit at once. The kernel allocates a hash map's buckets up
// front, 16 bytes per entry of capacity, for every identifier.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct port_set);
} port_sets SEC(".maps");

// The addresses each member may send from, by its host veth's ifindex
// (struct pod_sources): replicas share the programs, not their addresses.
// The plugin writes a member's entry before it attaches the programs.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, MAX_MEMBERS);
	__type(key, __u32);
	__type(value, struct pod_sources);
} sources SEC(".maps");

static __always_inline void count(int dir, int reason)
{
	__u32 idx = dir * REASON_MAX + reason;
	__u64 *c = bpf_map_lookup_elem(&counters, &idx);
	if (c)
		*c += 1;
}

union addr_words {
	__u64 w[2];
	__u8 b[16];
};

// pod_owns reports whether the pod behind the host veth ifindex may send
// from the address hi:lo (IPv6, or IPv4-mapped, as two words in memory
// order). A veth without an entry owns nothing: a member of an earlier
// build, say, sends nothing new until its entry is written. A global
// function, for the same reason as policy_lookup.
__attribute__((noinline)) int pod_owns(__u32 ifindex, __u64 hi, __u64 lo)
{
	struct pod_sources *s = bpf_map_lookup_elem(&sources, &ifindex);
	if (!s)
		return 0;
	if (s->flags & SOURCES_ANY)
		return 1;
	for (int i = 0; i < MAX_POD_ADDRS; i++) {
		if (i >= s->count)
			break;
		const __u64 *a = (const __u64 *)s->addrs[i];
		if (a[0] == hi && a[1] == lo)
			return 1;
	}
	return 0;
}

// source_is_pod reports whether a packet from the pod has one of the pod's
// own addresses as its source. Only new flows ask: a conntrack key holds
// the source and the host veth, so an entry proves the check was passed
// when it was written.
static __always_inline int source_is_pod(struct __sk_buff *skb, const int family, const struct flow *f)
{
	union addr_words a = {};
	if (family == 4) {
		a.w[1] = ((__u64)f->src.v4 << 32) | 0xffff0000ULL; // ::ffff:a.b.c.d
	} else {
		__builtin_memcpy(a.b, f->src.v6, 16);
	}
	return pod_owns(skb->ifindex, a.w[0], a.w[1]);
}

// Results of policy_lookup.
#define POLICY_DENIED 0
#define POLICY_ALLOWED 1
#define POLICY_ALLOWED_NODE 2

// Selector bits of the sel argument of policy_lookup and is_related.
#define SEL_EGRESS (1u << 31)
#define SEL_IPV6 (1u << 30)
#define SEL_SIDE_1 (1u << 28) // side 1's maps (struct id_state)
#define SEL_PROTO_SHIFT 16

// range_matches reports whether r allows port of protocol proto, without a
// branch (BPF has no conditional set, and every branch here is one more
// path for the verifier): both terms are negative exactly when the protocol
// matches (or the range is for any protocol) and first <= port <= last.
static __always_inline int range_matches(const struct port_range *r, __u32 proto, __u32 port)
{
	__s32 proto_miss = (__s32)((r->proto ^ proto) * r->proto) - 1;
	__s32 port_in = (__s32)((port - r->first) & 0xffff) - (__s32)(r->last - r->first) - 1;
	return (proto_miss & port_in) < 0;
}

// policy_lookup is the policy evaluation of a new or re-checked flow: the
// trie entry of the remote address, then a scan of its port ranges. It is a
// global function, which the verifier checks once on its own with unknown
// arguments, instead of once per path through its callers (a 64-iteration
// loop inlined at every such path multiplies the verifier's work twentyfold).
// Global functions take only scalars and the context on 5.10, hence the
// packed arguments: the address as two words and sel = direction | family |
// proto << 16 | port.
__attribute__((noinline)) int policy_lookup(__u64 addr_hi, __u64 addr_lo, __u32 sel)
{
	union addr_words a = {.w = {addr_hi, addr_lo}};
	struct lpm_key_v6 key = {.prefixlen = (sel & SEL_IPV6) ? 128 : 32};
	struct policy_value *v;
	__builtin_memcpy(key.addr, a.b, 16);

	if (sel & SEL_SIDE_1) {
		if (sel & SEL_EGRESS) {
			if (sel & SEL_IPV6) {
				v = bpf_map_lookup_elem(&pol_eg_v6_1, &key);
				KEEP_APART(10);
			} else {
				v = bpf_map_lookup_elem(&pol_eg_v4_1, &key);
				KEEP_APART(11);
			}
		} else {
			if (sel & SEL_IPV6) {
				v = bpf_map_lookup_elem(&pol_in_v6_1, &key);
				KEEP_APART(12);
			} else {
				v = bpf_map_lookup_elem(&pol_in_v4_1, &key);
				KEEP_APART(13);
			}
		}
	} else if (sel & SEL_EGRESS) {
		if (sel & SEL_IPV6) {
			v = bpf_map_lookup_elem(&pol_eg_v6, &key);
			KEEP_APART(0);
		} else {
			v = bpf_map_lookup_elem(&pol_eg_v4, &key);
			KEEP_APART(1);
		}
	} else {
		if (sel & SEL_IPV6) {
			v = bpf_map_lookup_elem(&pol_in_v6, &key);
			KEEP_APART(2);
		} else {
			v = bpf_map_lookup_elem(&pol_in_v4, &key);
			KEEP_APART(3);
		}
	}
	if (!v)
		return POLICY_DENIED;
	if (v->flags & POLICY_NODE)
		return POLICY_ALLOWED_NODE;

	__u32 proto = (sel >> SEL_PROTO_SHIFT) & 0xff;
	__u32 port = sel & 0xffff;
	if (v->count <= POLICY_INLINE_RANGES) {
		for (int i = 0; i < POLICY_INLINE_RANGES; i++)
			if (i < v->count && range_matches(&v->ranges[i], proto, port))
				return POLICY_ALLOWED;
		return POLICY_DENIED;
	}
	// ApplyPolicy writes a set before any entry names it and deletes it
	// only after no program can still hold such an entry.
	struct port_set *s = bpf_map_lookup_elem(&port_sets, &v->ports);
	if (!s)
		return POLICY_DENIED;
	for (int i = 0; i < MAX_PORT_RANGES; i++) {
		if (i >= s->count)
			break;
		if (range_matches(&s->ranges[i], proto, port))
			return POLICY_ALLOWED;
	}
	return POLICY_DENIED;
}

// Selector bit of tier_lookup's sel, beside SEL_EGRESS, SEL_IPV6 and the
// protocol and port.
#define SEL_BASELINE (1u << 29)

// port_set_holds reports whether the port set under key holds (proto,
// port): a global function, so that the verifier walks its loop once and
// not once per tier slot.
__attribute__((noinline)) int port_set_holds(__u32 key, __u32 proto, __u32 port)
{
	// ApplyPolicy writes a set before any entry names it and deletes it
	// only after no program can still hold such an entry.
	struct port_set *s = bpf_map_lookup_elem(&port_sets, &key);
	if (!s)
		return 0;
	for (int i = 0; i < MAX_PORT_RANGES; i++) {
		if (i >= s->count)
			break;
		if (range_matches(&s->ranges[i], proto, port))
			return 1;
	}
	return 0;
}

// tier_lookup finds the tier entry of the address hi:lo in the tier and
// direction sel selects, and returns the action (enum tier_action) of its
// first slot whose ports hold the flow's. sel is packed as for
// policy_lookup, with SEL_BASELINE for the Baseline tier.
__attribute__((noinline)) int tier_lookup(__u64 addr_hi, __u64 addr_lo, __u32 sel)
{
	union addr_words a = {.w = {addr_hi, addr_lo}};
	struct tier_key key = {
		.prefixlen = 8 + ((sel & SEL_IPV6) ? 128 : 32),
		.sel = ((sel & SEL_BASELINE) ? TIER_SEL_BASELINE : 0) | ((sel & SEL_EGRESS) ? TIER_SEL_EGRESS : 0) |
		       ((sel & SEL_IPV6) ? TIER_SEL_IPV6 : 0),
	};
	__builtin_memcpy(key.addr, a.b, 16);
	struct tier_value *v;
	if (sel & SEL_SIDE_1) {
		v = bpf_map_lookup_elem(&tiers_1, &key);
		KEEP_APART(14);
	} else {
		v = bpf_map_lookup_elem(&tiers, &key);
		KEEP_APART(15);
	}
	if (!v)
		return TIER_NO_MATCH;
	if (v->flags & TIER_ENTRY_NODE)
		return TIER_NODE;
	__u32 proto = (sel >> SEL_PROTO_SHIFT) & 0xff;
	__u32 port = sel & 0xffff;
	for (int i = 0; i < MAX_TIER_SLOTS; i++) {
		if (i >= v->count)
			break;
		struct tier_slot *s = &v->slots[i];
		int holds = s->count == 1 ? range_matches(&s->range, proto, port)
					  : s->count > 1 && port_set_holds(s->ports, proto, port);
		if (holds)
			return s->action;
	}
	return TIER_NO_MATCH;
}

// tier_reason is the reason a tier's action gives, or -1 when the tier
// leaves the flow to the next layer (no slot matched, or Pass).
static __always_inline int tier_reason(int action, int baseline)
{
	switch (action) {
	case TIER_NODE:
		return REASON_NODE;
	case TIER_ACCEPT:
		return baseline ? REASON_BASELINE_ACCEPT : REASON_ADMIN_ACCEPT;
	case TIER_DENY:
		return baseline ? REASON_BASELINE_DENY : REASON_ADMIN_DENY;
	}
	return -1;
}

// policy_reason is the reason of a policy_lookup result.
static __always_inline int policy_reason(int result)
{
	switch (result) {
	case POLICY_ALLOWED_NODE:
		return REASON_NODE;
	case POLICY_ALLOWED:
		return REASON_POLICY_ALLOW;
	}
	return REASON_POLICY_DENY;
}

// judge decides a flow in direction dir whose remote end is addr (network
// order, 4 or 16 bytes) and whose destination port is port, and returns the
// reason (an allowing or a denying one; reason_denies tells which). In
// order, each consulted only when enforced says so: the Admin tier (its
// Accept or Deny decides), NetworkPolicy (decides when it isolates the
// direction), the Baseline tier, strict mode's default deny. The node's
// addresses have entries in each of the ingress tries, so whichever is
// consulted first lets them through. A pod no cluster policy selects pays
// only the test of the Admin bit. side selects the maps (struct id_state).
static __always_inline int judge(int dir, const int family, __u32 side, __u8 enforced, const __u8 *addr,
				 __u8 proto, __u16 port)
{
	union addr_words a = {};
	__builtin_memcpy(a.b, addr, family == 4 ? 4 : 16);
	__u32 sel = (dir == DIR_EGRESS ? SEL_EGRESS : 0) | (family == 6 ? SEL_IPV6 : 0) | (side ? SEL_SIDE_1 : 0) |
		    ((__u32)proto << SEL_PROTO_SHIFT) | port;
	int r;
	if (enforced & (ENFORCE_ADMIN << dir)) {
		r = tier_reason(tier_lookup(a.w[0], a.w[1], sel), 0);
		if (r >= 0)
			return r;
	}
	if (enforced & (ENFORCE_POLICY << dir))
		return policy_reason(policy_lookup(a.w[0], a.w[1], sel));
	if (enforced & (ENFORCE_BASELINE << dir)) {
		r = tier_reason(tier_lookup(a.w[0], a.w[1], sel | SEL_BASELINE), 1);
		if (r >= 0)
			return r;
	}
	// Strict mode's default for a pod no PolicyEndpoint selects: its
	// policy tries hold the node's addresses and nothing else.
	if (enforced & (ENFORCE_DEFAULT_DENY << dir))
		return policy_reason(policy_lookup(a.w[0], a.w[1], sel));
	return REASON_NOT_ISOLATED;
}

// reason_denies tells the reasons judge gives to a flow it drops.
static __always_inline int reason_denies(int reason)
{
	return reason == REASON_POLICY_DENY || reason == REASON_ADMIN_DENY || reason == REASON_BASELINE_DENY ||
	       reason == REASON_UNTRANSLATED;
}

// take_event_token returns this CPU's budget with a token taken for one
// event, or NULL when none is left, which it counts as a dropped event. The
// value is per CPU, and TC programs run with preemption off: no atomics.
static __always_inline struct event_budget *take_event_token(__u64 now)
{
	__u32 zero = 0;
	struct event_budget *b = bpf_map_lookup_elem(&event_budget, &zero);
	if (!b)
		return 0;
	__u64 refill = (now - b->last_ns) >> EVENT_INTERVAL_SHIFT;
	if (refill) {
		b->tokens = b->tokens + refill > EVENT_BURST ? EVENT_BURST : b->tokens + refill;
		b->last_ns = now;
	}
	if (!b->tokens) {
		b->dropped++;
		return 0;
	}
	b->tokens--;
	return b;
}

// deny_at drops a packet of flow f, counting it and reporting it as seen on
// the host veth ifindex.
static __always_inline int deny_at(__u32 ifindex, const int dir, struct flow *f, int reason, __u64 now)
{
	count(dir, reason);
	struct event_budget *b = take_event_token(now);
	if (!b)
		return VERDICT_DROP;
	struct deny_event *e = bpf_ringbuf_reserve(&deny_events, sizeof(*e), 0);
	if (!e) {
		b->dropped++; // no reader keeps up: the ring buffer is full
		return VERDICT_DROP;
	}
	__builtin_memset(e, 0, sizeof(*e));
	e->timestamp_ns = now;
	e->ifindex = ifindex;
	e->family = f->family;
	e->proto = f->proto;
	e->direction = dir;
	e->reason = reason;
	e->sport = f->sport;
	e->dport = f->dport;
	if (f->family == 4) {
		__builtin_memcpy(e->src, f->src.v6, 4);
		__builtin_memcpy(e->dst, f->dst.v6, 4);
	} else {
		__builtin_memcpy(e->src, f->src.v6, 16);
		__builtin_memcpy(e->dst, f->dst.v6, 16);
	}
	bpf_ringbuf_submit(e, 0);
	return VERDICT_DROP;
}

static __always_inline int deny(struct __sk_buff *skb, const int dir, struct flow *f, int reason,
				__u64 now)
{
	return deny_at(skb->ifindex, dir, f, reason, now);
}

union ct_key {
	struct ct_key_v4 v4;
	struct ct_key_v6 v6;
};

static __always_inline void *ct_map(const int family)
{
	return family == 4 ? (void *)&ct_v4 : (void *)&ct_v6;
}

// CT_FILL fills one family's key; the two key types differ only in address size.
#define CT_FILL(k, pod, pod_port, peer, peer_port, proto_, ifidx, alen)                           \
	do {                                                                                       \
		__builtin_memcpy((k).src, pod, alen);                                              \
		__builtin_memcpy((k).dst, peer, alen);                                             \
		(k).sport = (pod_port);                                                            \
		(k).dport = (peer_port);                                                           \
		(k).proto = (proto_);                                                              \
		(k).pad[0] = (k).pad[1] = (k).pad[2] = 0;                                          \
		(k).ifindex = (ifidx);                                                             \
	} while (0)

// ct_key_fill builds the conntrack key of a packet that travels in
// direction dir. Keys are written from the pod's side (src is the pod, the
// owner of the entry; dst the peer), so a flow and its replies share one key
// and one lookup finds either; ct_value.flags records which side opened the
// flow.
static __always_inline void ct_key_fill(union ct_key *k, const int family, const int dir,
					const __u8 *src, const __u8 *dst, __u16 sport, __u16 dport,
					__u8 proto, __u32 ifindex)
{
	const __u8 *pod = dir == DIR_EGRESS ? src : dst;
	const __u8 *peer = dir == DIR_EGRESS ? dst : src;
	__u16 pod_port = dir == DIR_EGRESS ? sport : dport;
	__u16 peer_port = dir == DIR_EGRESS ? dport : sport;
	if (family == 4)
		CT_FILL(k->v4, pod, pod_port, peer, peer_port, proto, ifindex, 4);
	else
		CT_FILL(k->v6, pod, pod_port, peer, peer_port, proto, ifindex, 16);
}

// ct_current tells a tracked flow that passes without a policy lookup: one
// checked against the current policy generation, or one from the node's
// own addresses, which every policy allows.
static __always_inline int ct_current(const struct ct_value *v, __u32 generation)
{
	return v->generation == generation || (v->flags & CT_NODE);
}

// is_related reports whether an ICMP error, whose quote starts quote_off
// bytes into the frame, is about a flow conntrack holds and the current
// policy (generation) still allows: "fragmentation needed" or "packet too
// big" from a router on the path, which Path MTU discovery needs, or "port
// unreachable" from the peer. The quoted datagram went the other way, so
// its key is built for the opposite direction. Nothing is refreshed: an
// error does not keep a flow alive. The quote is parsed here, not with the
// rest of the packet, so that other packets pay nothing for it; and in a
// global function (sel = direction | family, as for policy_lookup), which
// the verifier checks once instead of in each of the four specialisations
// of enforce_family.
__attribute__((noinline)) int is_related(struct __sk_buff *skb, __u32 quote_off, __u32 sel,
					 __u32 generation)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	int dir = (sel & SEL_EGRESS) ? DIR_EGRESS : DIR_INGRESS;
	struct quoted q;
	union ct_key key;
	struct ct_value *v;
	if (sel & SEL_IPV6) {
		if (!parse_quoted(data, quote_off, end, 6, &q))
			return 0;
		ct_key_fill(&key, 6, !dir, q.src.v6, q.dst.v6, q.sport, q.dport, q.proto, skb->ifindex);
		v = bpf_map_lookup_elem(&ct_v6, &key);
		KEEP_APART(6);
	} else {
		if (!parse_quoted(data, quote_off, end, 4, &q))
			return 0;
		ct_key_fill(&key, 4, !dir, q.src.v6, q.dst.v6, q.sport, q.dport, q.proto, skb->ifindex);
		v = bpf_map_lookup_elem(&ct_v4, &key);
		KEEP_APART(4);
	}
	return v && ct_current(v, generation);
}

// allow_tracked passes a packet of a tracked flow. The entry is written only
// when something changed: the packets of a flow within one tick then leave
// its cache line alone, so that two CPUs handling the flow's two directions
// do not pass it back and forth (BenchmarkFlowBothWays).
static __always_inline int allow_tracked(const int dir, struct ct_value *v, __u32 generation,
					 int reason, __u64 now)
{
	if (v->generation != generation)
		v->generation = generation;
	// Forward only: each CPU caches its own reading of the clock (see
	// now_ns), and two CPUs writing alternately would move the line, and
	// last_seen, back and forth.
	if ((__s64)(now - v->last_seen_ns) > 0)
		v->last_seen_ns = now;
	count(dir, reason);
	return VERDICT_ALLOW;
}

static __always_inline int allow_new(const int dir, const int family, union ct_key *key,
				     __u32 generation, __u8 flags, __u64 now, int reason)
{
	struct ct_value nv = {
		.last_seen_ns = now,
		.generation = generation,
		.flags = flags | (dir == DIR_EGRESS ? CT_EGRESS : 0),
	};
	bpf_map_update_elem(ct_map(family), key, &nv, BPF_ANY);
	count(dir, reason);
	return VERDICT_ALLOW;
}

// frag_ports gives a later fragment the ports of its datagram's first
// fragment, which it records. A later fragment whose first was not seen
// (lost, reordered, or older than the map's memory) keeps ports 0, so only
// rules without a port restriction can allow it. Every fragment of a
// datagram goes the same way through the same veth, so the key needs no
// direction.
static __always_inline void frag_ports(const int family, struct flow *f)
{
	struct frag_key k = {.id = f->frag_id, .proto = f->proto, .family = family};
	__builtin_memcpy(k.src, f->src.v6, family == 4 ? 4 : 16);
	__builtin_memcpy(k.dst, f->dst.v6, family == 4 ? 4 : 16);
	if (f->frag == FRAG_FIRST) {
		struct frag_ports p = {.sport = f->sport, .dport = f->dport};
		bpf_map_update_elem(&frags, &k, &p, BPF_ANY);
		return;
	}
	struct frag_ports *p = bpf_map_lookup_elem(&frags, &k);
	if (p) {
		f->sport = p->sport;
		f->dport = p->dport;
	}
}

// answers tells whether the conntrack entry t is that of a flow the pod
// opened, of which f, at the pod's veth, is a reply: its original tuple is
// f reversed (the pod, to the frontend f comes from).
static __always_inline int answers(const int family, const struct flow *f, const struct translation *t)
{
	if (t->sport != f->dport || t->dport != f->sport)
		return 0;
	if (family == 4)
		return t->src.v4 == f->dst.v4 && t->dst.v4 == f->src.v4;
	const __u32 *a = (const __u32 *)t->src.v6, *b = (const __u32 *)f->dst.v6;
	const __u32 *c = (const __u32 *)t->dst.v6, *d = (const __u32 *)f->src.v6;
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3] && c[0] == d[0] && c[1] == d[1] &&
	       c[2] == d[2] && c[3] == d[3];
}

// judge_service hands a Service flow to the identifier's judge at the veth,
// in mode (service.h): a tracked one of a stale generation, judged again on
// its backend, or the first reply of one no judge tracked. Without a judge
// in the slot it cannot be judged: dropped.
static __always_inline int judge_service(struct __sk_buff *skb, const int dir, const int family,
					 struct flow *f, __u32 mode, __u64 now)
{
	skb->cb[CB_NEXT] = 0;
	skb->cb[CB_MODE] = mode;
	bpf_tail_call(skb, &judges, 2 * slot);
	return deny(skb, dir, f, REASON_UNTRANSLATED, now);
}

// enforce_family is specialised by the compiler per direction and family
// (both are constants), so the conntrack map references are constants too.
// Policy is evaluated at one place, for new flows and for tracked flows whose
// generation is stale alike: that keeps the verifier's work (and the load
// time of a first replica) small.
static __always_inline int enforce_family(struct __sk_buff *skb, const int dir, const int family,
					  struct flow *f, struct id_state *st)
{
	// The generation is read once, before anything else of the policy,
	// and its parity picks the side whose maps and enforced bits judge the
	// packet: ApplyPolicy fills the other side, then bumps the generation,
	// and rewrites the side it left only once no program run that read the
	// old generation is left. A packet is judged by one policy whole, the
	// one its generation stamps on the flow. (Programs of layouts before
	// sides read side 0 alone: policy.go's level covers them.)
	__u32 gen = *(volatile __u32 *)&st->generation;
	__u32 side = gen & 1;

	if (f->frag)
		frag_ports(family, f);
	// Every verdict from here on records the time: read it at one place,
	// which the verifier walks once rather than at each verdict.
	__u64 now = now_ns();

	// A packet from the pod opens nothing in another's name: its source
	// must be the pod's own, on every path that allows it without a
	// current entry (ICMP errors first, which the related check allows).
	if (dir == DIR_EGRESS && f->is_icmp_error && !source_is_pod(skb, family, f))
		return deny(skb, dir, f, REASON_SPOOFED, now);
	if (f->is_icmp_error &&
	    is_related(skb, f->quote_off, (dir == DIR_EGRESS ? SEL_EGRESS : 0) | (family == 6 ? SEL_IPV6 : 0),
		       gen)) {
		count(dir, REASON_CT_RELATED);
		return VERDICT_ALLOW;
	}

	union ct_key key; // every byte of the family's key is written below
	ct_key_fill(&key, family, dir, f->src.v6, f->dst.v6, f->sport, f->dport, f->proto, skb->ifindex);
	// A TCP SYN opens a connection, so there is nothing to look up: it is
	// judged as new (an allowed one overwrites a stale entry of the same
	// tuple). Simultaneous open, where both ends send a SYN, is judged as
	// two new flows.
	struct ct_value *v = NULL;
	if (!f->opens)
		v = bpf_map_lookup_elem(ct_map(family), &key);

	// A tracked flow is judged in the direction that opened it, a new flow
	// in this program's direction; either way the remote end is the peer.
	int eval_dir = dir;
	if (v) {
		eval_dir = (v->flags & CT_EGRESS) ? DIR_EGRESS : DIR_INGRESS;
		int reason = eval_dir == dir ? REASON_CT_ESTABLISHED : REASON_CT_REPLY;
		if (ct_current(v, gen))
			return allow_tracked(dir, v, gen, reason, now);
	}
	if (dir == DIR_EGRESS && !f->is_icmp_error && !source_is_pod(skb, family, f)) {
		if (v) // written by a build before this check
			bpf_map_delete_elem(ct_map(family), &key);
		return deny(skb, dir, f, REASON_SPOOFED, now);
	}
	// A Service flow is judged on its backend, which the kernel's
	// conntrack entry names: the identifier's judge does it (service.h).
	// So is a flow the pod opened to a frontend before it was isolated
	// (allowed then without a judgement) or by an earlier build: its peer
	// is the destination it sent to, the source of a reply.
	if (after_nat && v &&
	    ((v->flags & CT_SERVICE) ||
	     ((v->flags & CT_EGRESS) && !(v->flags & (CT_NODE | CT_DIRECT)) &&
	      (dir == DIR_EGRESS ? is_frontend(family, &f->dst, f->dport, f->proto)
				 : is_frontend(family, &f->src, f->sport, f->proto)))))
		return judge_service(skb, dir, family, f, dir == DIR_EGRESS ? MODE_VETH_FORWARD : MODE_VETH_REPLY,
				     now);
	asm volatile("" ::: "memory"); // after the generation (see above)
	__u8 enforced = side ? *(volatile __u8 *)&st->enforced_1 : *(volatile __u8 *)&st->enforced;
	// A packet from a frontend that nothing tracked: the reply of a flow
	// the veth stamped and no judge tracked (delivered to a socket of the
	// node, where no TC egress runs; or its entry evicted), or a new flow
	// from the frontend's address and port (an external IP anyone may
	// give a Service). The judge tells which by the kernel's conntrack
	// entry: a reply is judged on its backend before the pod sees it, and
	// tracked; anything else comes back here (cb says so: read only on
	// this path, which the verifier then walks once), judged below.
	if (dir == DIR_INGRESS && !v && after_nat && (enforced & (ENFORCE_ANY << DIR_EGRESS)) && !f->opens &&
	    !f->is_icmp_error && !f->frag && is_frontend(family, &f->src, f->sport, f->proto)) {
		if (skb->cb[CB_MODE] != CB_NEW_FLOW_0 || skb->cb[CB_NEXT] != CB_NEW_FLOW_1)
			return judge_service(skb, dir, family, f, MODE_VETH_FIRST, now);
		skb->cb[CB_MODE] = 0;
		skb->cb[CB_NEXT] = 0;
	}
	if (!v && !(enforced & (ENFORCE_ANY << dir)))
		return allow_new(dir, family, &key, gen, 0, now, REASON_NOT_ISOLATED);
	// A new flow to a Service frontend leaves with the slot in its mark,
	// to be judged where it leaves, after the translation.
	if (dir == DIR_EGRESS && !v && after_nat && !f->is_icmp_error && is_service(family, f)) {
		stamp(skb);
		return VERDICT_ALLOW;
	}

	// Ports are judged on the opening packet's destination: the peer's
	// port for a flow the pod opened, the pod's port otherwise.
	const __u8 *peer = dir == DIR_INGRESS ? f->src.v6 : f->dst.v6;
	__u16 pod_port = dir == DIR_EGRESS ? f->sport : f->dport;
	__u16 peer_port = dir == DIR_EGRESS ? f->dport : f->sport;
	__u16 dport = eval_dir == DIR_EGRESS ? peer_port : pod_port;
	int reason = REASON_NOT_ISOLATED;
	if (enforced & (ENFORCE_ANY << eval_dir))
		reason = judge(eval_dir, family, side, enforced, peer, f->proto, dport);

	if (v) {
		if (!reason_denies(reason))
			return allow_tracked(dir, v, gen,
					     eval_dir == dir ? REASON_CT_ESTABLISHED : REASON_CT_REPLY, now);
		bpf_map_delete_elem(ct_map(family), &key);
		return deny(skb, dir, f, REASON_REVOKED, now);
	}
	if (reason_denies(reason))
		return deny(skb, dir, f, reason, now);
	return allow_new(dir, family, &key, gen, reason == REASON_NODE ? CT_NODE : 0, now, reason);
}

static __always_inline int enforce(struct __sk_buff *skb, const int dir)
{

	// A packet that a pod's veth stamped, leaving by this pod's veth:
	// the sender's judge decides its egress first, then comes back here,
	// which needs this identifier's slot; without one it cannot be
	// judged: dropped.
	if (dispatch && dir == DIR_INGRESS) {
		__u32 s = stamped(skb);
		if (s) {
			if (!after_nat) {
				count(DIR_INGRESS, REASON_UNTRANSLATED);
				return VERDICT_DROP;
			}
			skb->cb[CB_NEXT] = 1 + 2 * slot + 1;
			skb->cb[CB_MODE] = MODE_OUTPUT;
			bpf_tail_call(skb, &judges, 2 * (s - 1));
			count(DIR_INGRESS, REASON_UNTRANSLATED); // no judge in the slot
			return VERDICT_DROP;
		}
	}

	struct flow f; // parse writes every field the family uses

	switch (parse(skb, &f)) {
	case PARSE_NOT_IP:
		count(dir, REASON_NOT_IP);
		return VERDICT_ALLOW;
	case PARSE_MALFORMED:
		count(dir, REASON_MALFORMED);
		return VERDICT_DROP;
	}
	if (f.link_ctl) {
		// Link control from the pod comes from its link-local or the
		// unspecified address (which parse demands of MLD), or from one
		// of its own; a neighbour advertisement in another's name is
		// spoofing like any other packet.
		if (dir == DIR_EGRESS && f.link_ctl == LINK_ND && !is_link_local6(f.src.v6) &&
		    !is_unspecified6(f.src.v6) && !source_is_pod(skb, 6, &f))
			return deny(skb, dir, &f, REASON_SPOOFED, now_ns());
		count(dir, REASON_ND);
		return VERDICT_ALLOW;
	}

	__u32 zero = 0;
	struct id_state *st = bpf_map_lookup_elem(&state, &zero);
	if (!st)
		return VERDICT_DROP; // an array map always has entry 0

	if (f.family == 4)
		return enforce_family(skb, dir, 4, &f, st);
	return enforce_family(skb, dir, 6, &f, st);
}

SEC("tc")
int pod_ingress(struct __sk_buff *skb)
{
	return enforce(skb, DIR_INGRESS);
}

SEC("tc")
int pod_egress(struct __sk_buff *skb)
{
	return enforce(skb, DIR_EGRESS);
}

// ---- After Service translation (service.h) ----

// judge_translated judges the Service flow f of the packet in direction
// dir on its backend, as mode says where it runs, and tracks it under the
// tuple the pod's veth sees. The sender's identifier's program: its maps,
// its generation and side.
static __always_inline int judge_translated(struct __sk_buff *skb, const int family, struct flow *f,
					    struct id_state *st, __u32 mode)
{
	__u32 gen = *(volatile __u32 *)&st->generation;
	__u32 side = gen & 1;
	__u64 now = now_ns();
	const int dir = mode == MODE_VETH_REPLY || mode == MODE_VETH_FIRST ? DIR_INGRESS : DIR_EGRESS;
	// At the device it leaves by, the packet came in by the pod's veth.
	// Both loaded before the choice: the verifier refuses a load through
	// a context pointer the compiler selected.
	__u32 in = skb->ingress_ifindex, here = skb->ifindex;
	asm volatile("" : "+r"(in), "+r"(here));
	__u32 veth = mode == MODE_OUTPUT ? in : here;

	struct translation t;
	union ct_key key;
	if (!translated(skb, family, f, mode == MODE_VETH_FORWARD, &t) ||
	    (mode == MODE_VETH_FIRST && !answers(family, f, &t))) {
		// No flow the pod opened (a socket bound to the frontend behind
		// a notrack rule has none either: pod_local tracked the flows
		// it allowed to one): back to the pod's ingress program, this
		// identifier's, as a new flow from the frontend.
		if (mode == MODE_VETH_FIRST) {
			skb->cb[CB_MODE] = CB_NEW_FLOW_0;
			skb->cb[CB_NEXT] = CB_NEW_FLOW_1;
			bpf_tail_call(skb, &judges, 2 * slot + 1);
			return deny_at(veth, DIR_INGRESS, f, REASON_UNTRANSLATED, now);
		}
		// At the veth, the kernel forgot the flow (an idle UDP flow, an
		// endpoint's entries flushed): so does podfence, and the flow's
		// next packet is a new one, judged as such.
		if (mode != MODE_OUTPUT) {
			ct_key_fill(&key, family, dir, f->src.v6, f->dst.v6, f->sport, f->dport, f->proto, veth);
			bpf_map_delete_elem(ct_map(family), &key);
		}
		return deny_at(veth, dir, f, REASON_UNTRANSLATED, now);
	}
	ct_key_fill(&key, family, DIR_EGRESS, t.src.v6, t.dst.v6, t.sport, t.dport, f->proto, veth);

	// Reported as judged: from the pod, to the backend.
	struct flow judged = *f;
	judged.src = t.src;
	judged.dst = t.backend;
	judged.sport = t.sport;
	judged.dport = t.backend_port;

	asm volatile("" ::: "memory"); // after the generation (enforce_family)
	__u8 enforced = side ? *(volatile __u8 *)&st->enforced_1 : *(volatile __u8 *)&st->enforced;
	int reason = REASON_NOT_ISOLATED;
	if (enforced & (ENFORCE_ANY << DIR_EGRESS))
		reason = judge(DIR_EGRESS, family, side, enforced, t.backend.v6, f->proto, t.backend_port);
	if (reason_denies(reason)) {
		bpf_map_delete_elem(ct_map(family), &key);
		// A new flow's judgement (where it leaves, or at its first
		// reply) is the egress one it is; a revocation is reported in
		// the direction of the packet it cut.
		if (mode == MODE_OUTPUT || mode == MODE_VETH_FIRST)
			return deny_at(veth, DIR_EGRESS, &judged, reason, now);
		return deny_at(veth, dir, &judged, REASON_REVOKED, now);
	}
	__u8 node = reason == REASON_NODE ? CT_NODE : 0;
	if (mode == MODE_VETH_FIRST)
		return allow_new(DIR_EGRESS, family, &key, gen, CT_SERVICE | node, now, reason);
	if (mode == MODE_OUTPUT) {
		allow_new(DIR_EGRESS, family, &key, gen, CT_SERVICE | node, now, reason);
		__u32 next = skb->cb[CB_NEXT];
		if (!next)
			return VERDICT_ALLOW; // an uplink
		skb->cb[CB_NEXT] = 0;
		bpf_tail_call(skb, &judges, next - 1);
		// The backend's own ingress judgement is not there to run.
		count(DIR_INGRESS, REASON_UNTRANSLATED);
		return VERDICT_DROP;
	}
	struct ct_value *v = bpf_map_lookup_elem(ct_map(family), &key);
	if (!v) // evicted meanwhile: the judgement stands
		return allow_new(DIR_EGRESS, family, &key, gen, CT_SERVICE, now, reason);
	if (!(v->flags & CT_SERVICE)) // opened before it was judged on its backend
		v->flags |= CT_SERVICE;
	return allow_tracked(dir, v, gen, dir == DIR_EGRESS ? REASON_CT_ESTABLISHED : REASON_CT_REPLY, now);
}

// pod_after_nat is an identifier's judge of its pods' Service flows,
// reached only by tail calls: from the ingress program of the veth a
// stamped packet leaves by, from uplink_after_nat, or from the identifier's
// own programs for a stale Service flow (cb says which, judge_mode).
SEC("tc")
int pod_after_nat(struct __sk_buff *skb)
{
	__u32 mode = skb->cb[CB_MODE];
	skb->cb[CB_MODE] = 0;
	unstamp(skb);
	struct flow f;
	if (parse(skb, &f) != PARSE_OK || f.link_ctl || f.frag) {
		// Nothing the veth stamps; a fragment's ports are not its own.
		count(DIR_EGRESS, REASON_UNTRANSLATED);
		return VERDICT_DROP;
	}
	__u32 zero = 0;
	struct id_state *st = bpf_map_lookup_elem(&state, &zero);
	if (!st)
		return VERDICT_DROP; // an array map always has entry 0
	if (f.family == 4)
		return judge_translated(skb, 4, &f, st, mode);
	return judge_translated(skb, 6, &f, st, mode);
}

// uplink_after_nat runs at the TC egress of the node's uplinks: a packet a
// pod's veth stamped, translated to a backend elsewhere, is judged by the
// sender's judge before it leaves the node.
SEC("tc")
int uplink_after_nat(struct __sk_buff *skb)
{
	__u32 s = stamped(skb);
	if (!s)
		return VERDICT_ALLOW;
	skb->cb[CB_NEXT] = 0;
	skb->cb[CB_MODE] = MODE_OUTPUT;
	bpf_tail_call(skb, &judges, 2 * (s - 1));
	return VERDICT_DROP; // no judge in the slot: it cannot be judged
}

// pod_local is an identifier's judge of its pods' Service flows delivered
// to a socket of the node (a host-network backend, the node itself, a
// socket bound to the frontend), where no TC egress runs: reached by a
// tail call from local_after_nat, it judges the packet's destination,
// translated already, with the identifier's maps. A translated flow is not
// tracked here (the frontend is not in the packet any more): its first
// reply is, at the pod's veth (MODE_VETH_FIRST), and until then each packet
// is judged here, counted there once for the flow. A flow to a socket bound
// to the frontend itself, which the kernel did not translate, is tracked
// here (CT_DIRECT): nothing at the veth could tell its replies from new
// flows.
SEC("cgroup_skb/ingress")
int pod_local(struct __sk_buff *skb)
{
	// Stamped by one of this identifier's veths, or not a stamp at all
	// (another component's mark in the same bits): left alone.
	__u32 veth = skb->ingress_ifindex;
	if (!bpf_map_lookup_elem(&sources, &veth))
		return 1;
	unstamp(skb);
	struct flow f;
	if (parse_delivered(skb, &f) != PARSE_OK) {
		count(DIR_EGRESS, REASON_UNTRANSLATED);
		return 0;
	}
	__u32 zero = 0;
	struct id_state *st = bpf_map_lookup_elem(&state, &zero);
	if (!st)
		return 0; // an array map always has entry 0
	__u32 gen = *(volatile __u32 *)&st->generation;
	__u32 side = gen & 1;
	asm volatile("" ::: "memory"); // after the generation (enforce_family)
	__u8 enforced = side ? *(volatile __u8 *)&st->enforced_1 : *(volatile __u8 *)&st->enforced;
	if (!(enforced & (ENFORCE_ANY << DIR_EGRESS)))
		return 1;
	int reason = f.family == 4 ? judge(DIR_EGRESS, 4, side, enforced, f.dst.v6, f.proto, f.dport)
				   : judge(DIR_EGRESS, 6, side, enforced, f.dst.v6, f.proto, f.dport);
	__u64 now = now_ns();
	if (reason_denies(reason)) {
		deny_at(veth, DIR_EGRESS, &f, reason, now);
		return 0;
	}
	if (!is_frontend(f.family, &f.dst, f.dport, f.proto))
		return 1;
	union ct_key key;
	if (f.family == 4) {
		ct_key_fill(&key, 4, DIR_EGRESS, f.src.v6, f.dst.v6, f.sport, f.dport, f.proto, veth);
		allow_new(DIR_EGRESS, 4, &key, gen, CT_DIRECT | (reason == REASON_NODE ? CT_NODE : 0), now, reason);
	} else {
		ct_key_fill(&key, 6, DIR_EGRESS, f.src.v6, f.dst.v6, f.sport, f.dport, f.proto, veth);
		allow_new(DIR_EGRESS, 6, &key, gen, CT_DIRECT | (reason == REASON_NODE ? CT_NODE : 0), now, reason);
	}
	return 1;
}

// local_after_nat runs at the ingress of the cgroup the sweeper hooks (the
// node's root by default): a packet a pod's veth stamped and the node
// delivered to one of its own sockets is judged by its sender's pod_local.
SEC("cgroup_skb/ingress")
int local_after_nat(struct __sk_buff *skb)
{
	__u32 s = stamped(skb);
	if (!s)
		return 1;
	bpf_tail_call(skb, &local_judges, s - 1);
	// No judge in the slot: no identifier holds it, so no veth stamped
	// the mark (another component's in the same bits).
	return 1;
}
