//go:build ignore
// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//
// The least a datapath with DESIGN.md's maps can cost: the two programs do
// only what any such datapath must do for a packet, with podfence's own key,
// value and trie types and map sizes (../types.h), so that BenchmarkLowerBound
// in ../ can put podfence's figures beside them. They handle untagged
// Ethernet, IPv4 without options or IPv6 without extension headers, and TCP
// or UDP: nothing else that a real datapath checks.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "../types.h"
#include "../calls.h"

char __license[] SEC("license") = "Dual BSD/GPL";

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, CT_V4_ENTRIES);
	__type(key, struct ct_key_v4);
	__type(value, struct ct_value);
} ct_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, CT_V6_ENTRIES);
	__type(key, struct ct_key_v6);
	__type(value, struct ct_value);
} ct_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, POLICY_TRIE_ENTRIES);
	__type(key, struct lpm_key_v4);
	__type(value, struct policy_value);
} pol_in_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, POLICY_TRIE_ENTRIES);
	__type(key, struct lpm_key_v6);
	__type(value, struct policy_value);
} pol_in_v6 SEC(".maps");

// Ports of a TCP or UDP header: both start with them.
struct l4_ports {
	__u16 sport;
	__u16 dport;
};

// The transport header follows the IP header directly: the lower bound
// handles no IPv4 options and no IPv6 extension headers. Keys are those of a
// packet to the pod: the pod is its destination, the peer its source.

#define CT_KEY(k, ip, p, skb, alen)                                                                \
	do {                                                                                       \
		__builtin_memcpy((k).src, &(ip)->daddr, alen);                                     \
		__builtin_memcpy((k).dst, &(ip)->saddr, alen);                                     \
		(k).ifindex = (skb)->ifindex;                                                      \
		(k).sport = bpf_ntohs((p)->dport);                                                 \
		(k).dport = bpf_ntohs((p)->sport);                                                 \
	} while (0)

// ct_hit is a conntrack hit: parse, and one lookup of the packet's key.
SEC("tc")
int ct_hit(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return TC_ACT_SHOT;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		struct l4_ports *p = (void *)(ip + 1);
		if ((void *)(p + 1) > end)
			return TC_ACT_SHOT;
		struct ct_key_v4 k = {.proto = ip->protocol};
		CT_KEY(k, ip, p, skb, 4);
		if (!bpf_map_lookup_elem(&ct_v4, &k))
			return TC_ACT_SHOT;
		KEEP_APART(4);
		return TC_ACT_UNSPEC;
	}
	if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip = (void *)(eth + 1);
		struct l4_ports *p = (void *)(ip + 1);
		if ((void *)(p + 1) > end)
			return TC_ACT_SHOT;
		struct ct_key_v6 k = {.proto = ip->nexthdr};
		CT_KEY(k, ip, p, skb, 16);
		if (!bpf_map_lookup_elem(&ct_v6, &k))
			return TC_ACT_SHOT;
		KEEP_APART(6);
		return TC_ACT_UNSPEC;
	}
	return TC_ACT_SHOT;
}

// new_flow is an allowed new flow: parse, one trie lookup of the peer, and
// the insert of its conntrack entry, stamped with the time.
SEC("tc")
int new_flow(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return TC_ACT_SHOT;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		struct l4_ports *p = (void *)(ip + 1);
		if ((void *)(p + 1) > end)
			return TC_ACT_SHOT;
		struct lpm_key_v4 peer = {.prefixlen = 32};
		__builtin_memcpy(peer.addr, &ip->saddr, 4);
		if (!bpf_map_lookup_elem(&pol_in_v4, &peer))
			return TC_ACT_SHOT;
		struct ct_key_v4 k = {.proto = ip->protocol};
		CT_KEY(k, ip, p, skb, 4);
		struct ct_value nv = {.last_seen_ns = bpf_ktime_get_ns()};
		bpf_map_update_elem(&ct_v4, &k, &nv, BPF_ANY);
		KEEP_APART(4);
		return TC_ACT_UNSPEC;
	}
	if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip = (void *)(eth + 1);
		struct l4_ports *p = (void *)(ip + 1);
		if ((void *)(p + 1) > end)
			return TC_ACT_SHOT;
		struct lpm_key_v6 peer = {.prefixlen = 128};
		__builtin_memcpy(peer.addr, &ip->saddr, 16);
		if (!bpf_map_lookup_elem(&pol_in_v6, &peer))
			return TC_ACT_SHOT;
		struct ct_key_v6 k = {.proto = ip->nexthdr};
		CT_KEY(k, ip, p, skb, 16);
		struct ct_value nv = {.last_seen_ns = bpf_ktime_get_ns()};
		bpf_map_update_elem(&ct_v6, &k, &nv, BPF_ANY);
		KEEP_APART(6);
		return TC_ACT_UNSPEC;
	}
	return TC_ACT_SHOT;
}
