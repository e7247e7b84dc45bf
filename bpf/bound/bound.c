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
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "../maps.h"
#include "../clock.h"
#include "../calls.h"

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

// ---- What judging a pod's egress after Service translation would add ----
//
// podfence judges a pod's egress at its veth, before kube-proxy's DNAT: it
// sees a Service's ClusterIP, not the backend. A judge after the DNAT runs
// where the packet leaves the node's routing (the backend pod's veth, the
// node's uplink), one program for every pod, which finds the sending
// pod's egress policy by the packet's source address: one more lookup, in
// a map of maps, on a new flow. new_flow_post_dnat is new_flow with that
// lookup (IPv4; IPv6 the same with 16-byte keys), for
// BenchmarkPostDNATCost: it is not part of podfence.

struct {
	__uint(type, BPF_MAP_TYPE_HASH_OF_MAPS);
	__uint(max_entries, 1024);
	__type(key, __u32); // the sending pod's IPv4 address
	__array(values, struct {
		__uint(type, BPF_MAP_TYPE_LPM_TRIE);
		__uint(map_flags, BPF_F_NO_PREALLOC);
		__uint(max_entries, POLICY_TRIE_ENTRIES);
		__type(key, struct lpm_key_v4);
		__type(value, struct policy_value);
	});
} egress_by_pod_v4 SEC(".maps");

SEC("tc")
int new_flow_post_dnat(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	if (ether_type(data, end) != bpf_htons(ETH_P_IP))
		return TC_ACT_SHOT;
	struct iphdr *ip = data + sizeof(struct ethhdr);
	struct l4_ports *p = (void *)(ip + 1);
	if ((void *)(p + 1) > end)
		return TC_ACT_SHOT;
	// The packet leaves the pod: its source is the pod, its destination
	// the backend the DNAT chose.
	__u32 pod = ip->saddr;
	void *trie = bpf_map_lookup_elem(&egress_by_pod_v4, &pod);
	if (!trie)
		return TC_ACT_SHOT;
	struct lpm_key_v4 peer = {.prefixlen = 32};
	__builtin_memcpy(peer.addr, &ip->daddr, 4);
	if (!bpf_map_lookup_elem(trie, &peer))
		return TC_ACT_SHOT;
	struct ct_key_v4 k = {};
	__builtin_memcpy(k.src, &ip->saddr, 4);
	__builtin_memcpy(k.dst, &ip->daddr, 4);
	k.ifindex = skb->ifindex;
	k.sport = bpf_ntohs(p->sport);
	k.dport = bpf_ntohs(p->dport);
	k.proto = ip->protocol;
	struct ct_value nv = {.last_seen_ns = now_ns(), .generation = generation()};
	bpf_map_update_elem(&ct_v4, &k, &nv, BPF_ANY);
	return TC_ACT_UNSPEC;
}
