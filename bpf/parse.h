// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
// Packet parsing: Ethernet, IPv4 (with options), IPv6 (with extension
// headers), and the L4 fields conntrack and policy need.
#pragma once

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

// Extension headers walked before giving up; a chain longer than this is malformed.
#ifndef MAX_EXT_HDRS
#define MAX_EXT_HDRS 8
#endif

// Bytes made linear when the headers are not (GSO, paged skbs). Headers
// beyond this are treated as truncated.
#define PULL_LEN 512

enum parse_result {
	PARSE_OK,
	PARSE_NOT_IP,
	PARSE_MALFORMED,
};

struct flow {
	union {
		__be32 v4;
		__u8 v6[16];
	} src, dst;  // network byte order
	__u16 sport; // host byte order; ICMP echo identifier; 0 for non-first fragments
	__u16 dport;
	__u8 family; // 4 or 6
	__u8 proto;
	__u8 opens;  // a TCP SYN without ACK: the first packet of a connection
};

struct l4_ports {
	__be16 sport;
	__be16 dport;
};

// The TCP header up to its flags.
struct tcp_head {
	__be16 sport;
	__be16 dport;
	__be32 seq;
	__be32 ack_seq;
	__u8 doff;
	__u8 flags;
};

#define TCP_SYN 0x02
#define TCP_ACK 0x10

struct icmp_echo {
	__u8 type;
	__u8 code;
	__be16 csum;
	__be16 id;
	__be16 seq;
};

struct ext_hdr {
	__u8 nexthdr;
	__u8 hdrlen;
	__be16 frag_off; // fragment header only
};

// parse_l4 reads ports at l4. A non-first fragment carries no L4 header: its
// ports stay 0, so only rules without a port restriction can allow it.
static __always_inline int parse_l4(void *l4, void *end, struct flow *f, int first_fragment)
{
	if (!first_fragment)
		return PARSE_OK;

	switch (f->proto) {
	case IPPROTO_TCP: {
		struct tcp_head *t = l4;
		if ((void *)(t + 1) > end)
			return PARSE_MALFORMED;
		f->sport = bpf_ntohs(t->sport);
		f->dport = bpf_ntohs(t->dport);
		f->opens = (t->flags & (TCP_SYN | TCP_ACK)) == TCP_SYN;
		return PARSE_OK;
	}
	case IPPROTO_UDP:
	case IPPROTO_SCTP: {
		struct l4_ports *p = l4;
		if ((void *)(p + 1) > end)
			return PARSE_MALFORMED;
		f->sport = bpf_ntohs(p->sport);
		f->dport = bpf_ntohs(p->dport);
		return PARSE_OK;
	}
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6: {
		struct icmp_echo *e = l4;
		if ((void *)(e + 1) > end)
			return PARSE_MALFORMED;
		// Echo request/reply (ICMP 8/0, ICMPv6 128/129) keep the identifier
		// in both ports; other messages are tracked with ports 0.
		if (e->type == 8 || e->type == 0 || e->type == 128 || e->type == 129) {
			f->sport = bpf_ntohs(e->id);
			f->dport = f->sport;
		}
		return PARSE_OK;
	}
	}
	return PARSE_OK;
}

static __always_inline int parse_ipv4(void *data, void *end, struct flow *f)
{
	struct iphdr *ip = data + sizeof(struct ethhdr);
	if ((void *)(ip + 1) > end)
		return PARSE_MALFORMED;
	if (ip->version != 4 || ip->ihl < 5)
		return PARSE_MALFORMED;
	void *l4 = (void *)ip + ip->ihl * 4;
	if (l4 > end)
		return PARSE_MALFORMED;

	f->family = 4;
	f->proto = ip->protocol;
	f->src.v4 = ip->saddr;
	f->dst.v4 = ip->daddr;
	return parse_l4(l4, end, f, !(ip->frag_off & bpf_htons(0x1fff)));
}

// bounded returns an offset already checked to be at most PULL_LEN, masked
// so that the verifier sees the bound on the very register added to the
// packet pointer: the verifiers of 5.10 and 6.1 (not 6.12) lose a bound
// learnt from a comparison across a 32-bit register copy, which clang is
// free to make between the check and the addition.
static __always_inline __u32 bounded(__u32 off)
{
	// Hide the range from clang, which would otherwise drop the mask as
	// redundant after the caller's check.
	asm volatile("" : "+r"(off));
	return off & (2 * PULL_LEN - 1);
}

// is_zero is 1 when x (below 2^31) is 0, else 0, without a branch.
static __always_inline __u32 is_zero(__u32 x)
{
	return (x - 1) >> 31;
}

static __always_inline int is_ext_hdr(__u32 next)
{
	return next == IPPROTO_HOPOPTS || next == IPPROTO_ROUTING || next == IPPROTO_DSTOPTS ||
	       next == IPPROTO_FRAGMENT || next == IPPROTO_AH;
}

static __always_inline int parse_ipv6(void *data, void *end, struct flow *f)
{
	struct ipv6hdr *ip6 = data + sizeof(struct ethhdr);
	if ((void *)(ip6 + 1) > end)
		return PARSE_MALFORMED;
	if (ip6->version != 6)
		return PARSE_MALFORMED;

	f->family = 6;
	__builtin_memcpy(f->src.v6, &ip6->saddr, 16);
	__builtin_memcpy(f->dst.v6, &ip6->daddr, 16);

	__u32 next = ip6->nexthdr;
	__u32 off = sizeof(struct ethhdr) + sizeof(struct ipv6hdr);

	// The common case, an upper-layer header right after the IPv6 header,
	// skips the walk.
	int i;
	for (i = 0; i < MAX_EXT_HDRS && is_ext_hdr(next); i++) {
		if (off > PULL_LEN)
			return PARSE_MALFORMED;
		struct ext_hdr *h = data + bounded(off);
		if ((void *)(h + 1) > end)
			return PARSE_MALFORMED;
		__u32 is_frag = is_zero(next ^ IPPROTO_FRAGMENT);
		// A non-first fragment has no upper-layer header to read: stop
		// here with ports 0.
		if (is_frag && (h->frag_off & bpf_htons(0xfff8))) {
			f->proto = h->nexthdr;
			return PARSE_OK;
		}
		// The length without a branch per header type, so the verifier
		// follows one path through each iteration instead of three:
		// AH counts 4-byte units less 2, the others 8-byte units less 1,
		// and the fragment header (whose length byte is reserved) is 8.
		__u32 is_ah = is_zero(next ^ IPPROTO_AH);
		__u32 units = (__u32)h->hdrlen & (is_frag - 1);
		off += (units + 1 + is_ah) << (3 - is_ah);
		next = h->nexthdr;
	}
	if (i == MAX_EXT_HDRS && is_ext_hdr(next))
		return PARSE_MALFORMED;
	if (off > PULL_LEN)
		return PARSE_MALFORMED;

	void *l4 = data + bounded(off);
	if (l4 > end)
		return PARSE_MALFORMED;
	f->proto = next;
	return parse_l4(l4, end, f, 1);
}

// parse fills f from the packet. It may pull non-linear headers into the
// linear area, which invalidates packet pointers the caller held before.
static __always_inline int parse(struct __sk_buff *skb, struct flow *f)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	__u32 linear = end - data;

	f->sport = 0;
	f->dport = 0;
	f->opens = 0;

	if (linear < skb->len && linear < PULL_LEN) {
		bpf_skb_pull_data(skb, skb->len < PULL_LEN ? skb->len : PULL_LEN);
		data = (void *)(long)skb->data;
		end = (void *)(long)skb->data_end;
	}

	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return PARSE_MALFORMED;

	switch (eth->h_proto) {
	case bpf_htons(ETH_P_IP):
		return parse_ipv4(data, end, f);
	case bpf_htons(ETH_P_IPV6):
		return parse_ipv6(data, end, f);
	}
	return PARSE_NOT_IP;
}
