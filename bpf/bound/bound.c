//go:build ignore
// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//
// The least a datapath with DESIGN.md's maps can cost: the two programs
// parse a packet and do the map operations DESIGN.md prescribes for it, on
// podfence's own map definitions (../maps.h) and clock (../clock.h), so
// that BenchmarkLowerBound in ../ can put podfence's figures beside them.
// They handle untagged Ethernet, IPv4 without options or IPv6 without
// extension headers, and TCP or UDP; they count nothing and evaluate no
// ports: nothing else that a real datapath checks.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "../maps.h"
#include "../clock.h"
#include "../calls.h"
#include "../conntrack.h"

char __license[] SEC("license") = "Dual BSD/GPL";

CT_MAP(ct_v4, struct ct_key_v4, CT_V4_ENTRIES);
CT_MAP(ct_v6, struct ct_key_v6, CT_V6_ENTRIES);
POLICY_TRIE(pol_in_v4, struct lpm_key_v4);
POLICY_TRIE(pol_in_v6, struct lpm_key_v6);
STATE_MAP(state);

// Ports of a TCP or UDP header: both start with them.
struct l4_ports {
	__u16 sport;
	__u16 dport;
};

// The keys of a packet to the pod: the pod is its destination, the peer its
// source. The transport header follows the IP header directly.
#define FLOW_KEYS(ip_type, proto_field, alen, plen)                                                \
	ip_type *ip = data + sizeof(struct ethhdr);                                                \
	struct l4_ports *p = (void *)(ip + 1);                                                     \
	if ((void *)(p + 1) > end)                                                                 \
		return 0;                                                                          \
	__builtin_memcpy(k->src, &ip->daddr, alen);                                                \
	__builtin_memcpy(k->dst, &ip->saddr, alen);                                                \
	k->ifindex = skb->ifindex;                                                                 \
	k->sport = bpf_ntohs(p->dport);                                                            \
	k->dport = bpf_ntohs(p->sport);                                                            \
	k->proto = ip->proto_field;                                                                \
	__builtin_memset(k->pad, 0, sizeof(k->pad));                                               \
	peer->prefixlen = plen;                                                                    \
	__builtin_memcpy(peer->addr, &ip->saddr, alen);                                            \
	return 1

static __always_inline int keys_v4(struct __sk_buff *skb, void *data, void *end, struct ct_key_v4 *k,
				   struct lpm_key_v4 *peer)
{
	FLOW_KEYS(struct iphdr, protocol, 4, 32);
}

static __always_inline int keys_v6(struct __sk_buff *skb, void *data, void *end, struct ct_key_v6 *k,
				   struct lpm_key_v6 *peer)
{
	FLOW_KEYS(struct ipv6hdr, nexthdr, 16, 128);
}

// ether_type is the frame's EtherType in network order, 0 for a runt.
static __always_inline __u16 ether_type(void *data, void *end)
{
	struct ethhdr *eth = data;
	return (void *)(eth + 1) > end ? 0 : eth->h_proto;
}

// generation is the identifier's policy generation.
static __always_inline __u32 generation(void)
{
	__u32 zero = 0;
	struct id_state *st = bpf_map_lookup_elem(&state, &zero);
	return st ? st->generation : 0;
}

// tracked passes a tracked flow checked against the current generation, and
// refreshes its last_seen.
static __always_inline int tracked(struct ct_value *v)
{
	if (!v || v->generation != generation())
		return TC_ACT_SHOT;
	__u64 now = now_ns();
	if ((__s64)(now - v->last_seen_ns) > 0)
		v->last_seen_ns = now;
	return TC_ACT_UNSPEC;
}

// ct_hit is a conntrack hit: parse, one lookup of the packet's key, the
// generation check and the refresh of last_seen.
SEC("tc")
int ct_hit(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	switch (ether_type(data, end)) {
	case bpf_htons(ETH_P_IP): {
		struct ct_key_v4 k;
		struct lpm_key_v4 peer;
		if (!keys_v4(skb, data, end, &k, &peer))
			return TC_ACT_SHOT;
		struct ct_value *v = bpf_map_lookup_elem(&ct_v4, &k);
		KEEP_APART(4);
		return tracked(v);
	}
	case bpf_htons(ETH_P_IPV6): {
		struct ct_key_v6 k;
		struct lpm_key_v6 peer;
		if (!keys_v6(skb, data, end, &k, &peer))
			return TC_ACT_SHOT;
		struct ct_value *v = bpf_map_lookup_elem(&ct_v6, &k);
		KEEP_APART(6);
		return tracked(v);
	}
	}
	return TC_ACT_SHOT;
}

// new_flow is an allowed new flow: parse, one trie lookup of the peer, and
// the insert of its conntrack entry with the time and the generation.
SEC("tc")
int new_flow(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	switch (ether_type(data, end)) {
	case bpf_htons(ETH_P_IP): {
		struct ct_key_v4 k;
		struct lpm_key_v4 peer;
		if (!keys_v4(skb, data, end, &k, &peer) || !bpf_map_lookup_elem(&pol_in_v4, &peer))
			return TC_ACT_SHOT;
		struct ct_value nv = {.last_seen_ns = now_ns(), .generation = generation()};
		bpf_map_update_elem(&ct_v4, &k, &nv, BPF_ANY);
		KEEP_APART(4);
		return TC_ACT_UNSPEC;
	}
	case bpf_htons(ETH_P_IPV6): {
		struct ct_key_v6 k;
		struct lpm_key_v6 peer;
		if (!keys_v6(skb, data, end, &k, &peer) || !bpf_map_lookup_elem(&pol_in_v6, &peer))
			return TC_ACT_SHOT;
		struct ct_value nv = {.last_seen_ns = now_ns(), .generation = generation()};
		bpf_map_update_elem(&ct_v6, &k, &nv, BPF_ANY);
		KEEP_APART(6);
		return TC_ACT_UNSPEC;
	}
	}
	return TC_ACT_SHOT;
}

// ---- Judging a pod's egress after Service translation: three designs ----
//
// podfence judges a pod's egress at its veth, before kube-proxy's DNAT: it
// sees a Service's ClusterIP, not the backend. A judge after the DNAT runs
// where the packet leaves the node's routing (the backend pod's veth, the
// node's uplink), one program for every pod, and must first find whose
// egress policy applies. BenchmarkEgressAfterNAT (package bpf) loads one
// copy of this object per pod, as podfence loads one datapath per
// identifier: each copy's pol_in_v4 stands for that pod's egress trie, and
// the copies share ct_v4, judges and egress_by_pod_v4. None of this is part
// of podfence.

// slot is this copy's index in judges (set at load).
volatile const __u32 slot;

// The judges of the node's identifiers, by slot: each copy's
// judge_after_nat, reached by a tail call so that it reads its own maps.
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, MAX_MEMBERS);
	__type(key, __u32);
	__type(value, __u32);
} judges SEC(".maps");

// The bits of skb->mark that carry slot + 1 from the veth to the device the
// packet leaves by (0: nothing to judge). kube-proxy owns 0x4000 and
// 0x8000, the VPC CNI 0x80; a real datapath would take its mask from the
// configuration.
#define SLOT_SHIFT 16
#define SLOT_MASK (0x7ffu << SLOT_SHIFT)

// stamp is the veth's half of designs M and M+C.
static __always_inline void stamp(struct __sk_buff *skb)
{
	volatile __u32 *mark = &skb->mark;
	*mark = (*mark & ~SLOT_MASK) | ((slot + 1) << SLOT_SHIFT);
}

// stamped is the slot + 1 the veth stamped, read where the packet leaves.
static __always_inline __u32 stamped(struct __sk_buff *skb)
{
	volatile __u32 *mark = &skb->mark;
	return (*mark & SLOT_MASK) >> SLOT_SHIFT;
}

// egress_new is an allowed new flow from the pod: parse, one lookup of the
// destination in the trie, the conntrack insert.
static __always_inline int egress_new(struct __sk_buff *skb, void *trie, const int translated)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	if (ether_type(data, end) != bpf_htons(ETH_P_IP))
		return TC_ACT_SHOT;
	struct iphdr *ip = data + sizeof(struct ethhdr);
	struct l4_ports *p = (void *)(ip + 1);
	if ((void *)(p + 1) > end)
		return TC_ACT_SHOT;
	struct lpm_key_v4 peer = {.prefixlen = 32};
	__builtin_memcpy(peer.addr, &ip->daddr, 4);
	if (!bpf_map_lookup_elem(trie, &peer))
		return TC_ACT_SHOT;
	// Under the tuple the pod sent, where the veth looks the flow up: cb
	// holds it after a translation (design C), else the packet does.
	__u32 src = ip->saddr, dst = ip->daddr;
	__u16 dport = p->dport;
	if (translated) {
		// Loaded before the choice, or the compiler selects between a
		// packet and a context pointer, which the verifier refuses.
		__u32 osrc = skb->cb[0], odst = skb->cb[1], oport = skb->cb[2];
		asm volatile("" : "+r"(osrc), "+r"(odst), "+r"(oport));
		if (odst) {
			src = osrc;
			dst = odst;
			dport = oport;
		}
	}
	struct ct_key_v4 k = {};
	__builtin_memcpy(k.src, &src, 4);
	__builtin_memcpy(k.dst, &dst, 4);
	k.ifindex = skb->ifindex;
	k.sport = bpf_ntohs(p->sport);
	k.dport = bpf_ntohs(dport);
	k.proto = ip->protocol;
	struct ct_value nv = {.last_seen_ns = now_ns(), .generation = generation()};
	bpf_map_update_elem(&ct_v4, &k, &nv, BPF_ANY);
	return TC_ACT_UNSPEC;
}

// veth_egress_new is today's judgement, at the sending pod's veth.
SEC("tc")
int veth_egress_new(struct __sk_buff *skb)
{
	return egress_new(skb, &pol_in_v4, 0);
}

// judge_after_nat is the same judgement after the DNAT, tail-called.
SEC("tc")
int judge_after_nat(struct __sk_buff *skb)
{
	return egress_new(skb, &pol_in_v4, 1);
}

// Design M (skb mark, tail call): the veth's program stamps its slot in the
// packet's mark and lets it pass; where it leaves, the node's program
// tail-calls that slot's judge. mark_then_judge is both halves in one run:
// the mark is written and read back through the context, as at the two
// hooks, and the tail call is the output device's.
SEC("tc")
int mark_then_judge(struct __sk_buff *skb)
{
	stamp(skb);                // at the veth
	__u32 s = stamped(skb);    // where it leaves
	if (!s)
		return TC_ACT_UNSPEC; // judged at the veth (a tracked flow), or no pod's
	skb->cb[1] = 0;            // no original tuple: the judge keys on the packet's
	bpf_tail_call(skb, &judges, s - 1);
	return TC_ACT_SHOT; // no judge in the slot: fail closed
}

// Design S (source address, map of maps): where the packet leaves, the
// sending pod's trie is found by the packet's source address. A masquerade
// or hairpin SNAT before that hook hides it.
struct {
	__uint(type, BPF_MAP_TYPE_HASH_OF_MAPS);
	__uint(max_entries, MAX_MEMBERS);
	__type(key, __u32); // the sending pod's IPv4 address
	__array(values, struct {
		__uint(type, BPF_MAP_TYPE_LPM_TRIE);
		__uint(map_flags, BPF_F_NO_PREALLOC);
		__uint(max_entries, POLICY_TRIE_ENTRIES);
		__type(key, struct lpm_key_v4);
		__type(value, struct policy_value);
	});
} egress_by_pod_v4 SEC(".maps");

static __always_inline void *trie_by_source(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct iphdr *ip = data + sizeof(struct ethhdr);
	if ((void *)(ip + 1) > end)
		return 0;
	__u32 pod = ip->saddr;
	return bpf_map_lookup_elem(&egress_by_pod_v4, &pod);
}

SEC("tc")
int source_then_judge(struct __sk_buff *skb)
{
	void *trie = trie_by_source(skb);
	if (!trie)
		return TC_ACT_SHOT;
	return egress_new(skb, trie, 0);
}

// Design C (conntrack kfunc, 5.18 and later): where the packet leaves, the
// kernel's conntrack entry (confirmed by then: POSTROUTING is over) gives
// the tuple the pod sent, before the DNAT and any SNAT: its source finds
// the pod for design S, its destination is where the veth sees the flow's
// later packets and replies, so the flow's entry in ct_v4 is written under
// it. The programs below look up the entry the benchmark created (a fixed
// tuple: the cost of a hash lookup does not depend on it), read its
// original tuple and release it; the judge then reads that tuple from cb.

// The benchmark's conntrack entry, looked up instead of the packet's when
// ct_fixed is set: the cost of a hash lookup does not depend on the tuple.
volatile const __u8 ct_fixed;
volatile const __u32 ct_saddr, ct_daddr;
volatile const __u16 ct_sport, ct_dport;

// original_tuple puts the original source, destination and destination
// port of the packet's conntrack entry in cb[0..2]. After a DNAT (and any
// SNAT) the packet's own tuple, reversed, is the entry's reply tuple. 0
// when there is no entry, or no kfunc.
static __always_inline int original_tuple(struct __sk_buff *skb)
{
	if (!bpf_skb_ct_lookup) // weak: 0 where the kernel has no such kfunc
		return 0;
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct iphdr *ip = data + sizeof(struct ethhdr);
	struct l4_ports *p = (void *)(ip + 1);
	if ((void *)(p + 1) > end)
		return 0;
	struct bpf_sock_tuple t = {};
	if (ct_fixed) {
		t.ipv4.saddr = ct_saddr;
		t.ipv4.daddr = ct_daddr;
		t.ipv4.sport = ct_sport;
		t.ipv4.dport = ct_dport;
	} else {
		t.ipv4.saddr = ip->daddr;
		t.ipv4.daddr = ip->saddr;
		t.ipv4.sport = p->dport;
		t.ipv4.dport = p->sport;
	}
	struct bpf_ct_opts___pf o = {.netns_id = CT_OPTS_CURRENT_NETNS, .l4proto = ip->protocol};
	struct nf_conn *ct = bpf_skb_ct_lookup(skb, &t, sizeof(t.ipv4), &o, sizeof(o));
	if (!ct)
		return 0;
	skb->cb[0] = ct->tuplehash[0].tuple.src.u3.ip;
	skb->cb[1] = ct->tuplehash[0].tuple.dst.u3.ip;
	skb->cb[2] = ct->tuplehash[0].tuple.dst.u.all;
	bpf_ct_release(ct);
	return 1;
}

SEC("tc")
int ct_then_judge(struct __sk_buff *skb)
{
	if (!original_tuple(skb))
		return TC_ACT_SHOT;
	// By the packet's source: the entry is the benchmark's one, and the
	// source is the original one where no SNAT changed it (the same lookup).
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct iphdr *ip = data + sizeof(struct ethhdr);
	if ((void *)(ip + 1) > end)
		return TC_ACT_SHOT;
	__u32 pod = skb->cb[0];
	if (pod == ct_saddr)
		pod = ip->saddr;
	void *trie = bpf_map_lookup_elem(&egress_by_pod_v4, &pod);
	if (!trie)
		return TC_ACT_SHOT;
	return egress_new(skb, trie, 0);
}

// Design M+C: the mark finds the judge, the kfunc the flow's original
// tuple. stamp_slot is the veth's half, after_nat the half where the packet
// leaves (TestAfterNATFacilities attaches both); mark_then_ct_judge is
// both in one run, for the benchmark.

static __always_inline int dispatch(struct __sk_buff *skb)
{
	__u32 s = stamped(skb);
	if (!s)
		return TC_ACT_UNSPEC; // judged at the veth (a tracked flow), or no pod's
	if (!original_tuple(skb))
		return TC_ACT_SHOT; // cannot be judged after the DNAT: fail closed
	bpf_tail_call(skb, &judges, s - 1);
	return TC_ACT_SHOT; // no judge in the slot: fail closed
}

SEC("tc")
int stamp_slot(struct __sk_buff *skb)
{
	stamp(skb);
	return TC_ACT_UNSPEC;
}

SEC("tc")
int after_nat(struct __sk_buff *skb)
{
	return dispatch(skb);
}

SEC("tc")
int mark_ct_then_judge(struct __sk_buff *skb)
{
	stamp(skb);
	return dispatch(skb);
}
