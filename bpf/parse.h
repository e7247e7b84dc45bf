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
// The same for the datagram an ICMPv6 error quotes, where a longer chain
// leaves the error to be judged on its own. Each header walked there costs
// the verifier about 250 instructions per program.
#define MAX_QUOTED_EXT_HDRS 4

// Bytes made linear when the headers are not (GSO, paged skbs). Headers
// beyond this are treated as truncated.
#define PULL_LEN 512

enum parse_result {
	PARSE_OK,
	PARSE_NOT_IP,
	PARSE_MALFORMED,
};

union ip_addr {
	__be32 v4;
	__u8 v6[16];
};

// The datagram an ICMP error quotes (RFC 792, RFC 4443): the start of a
// packet that went the other way, whose flow the error belongs to.
struct quoted {
	union ip_addr src, dst; // network byte order
	__u16 sport;            // host byte order; ICMP echo identifier
	__u16 dport;
	__u8 proto;
};

// IPv6 control messages that never leave the link, passed like ARP.
enum link_ctl {
	LINK_NONE = 0,
	LINK_ND = 1,  // neighbour discovery (RFC 4861)
	LINK_MLD = 2, // multicast listener query, report or done (RFC 2710, RFC 3810)
};

enum frag_kind {
	FRAG_NONE = 0,  // a whole datagram
	FRAG_FIRST = 1, // offset 0 with more to come: carries the ports
	FRAG_LATER = 2, // no transport header: ports come from the first (see frag_ports)
};

struct flow {
	union ip_addr src, dst; // network byte order
	__u16 sport; // host byte order; ICMP echo identifier; 0 for later fragments
	__u16 dport;
	__u32 frag_id; // the datagram's identification (network order), for fragments
	__u8 frag;     // enum frag_kind
	__u8 family; // 4 or 6
	__u8 proto;
	__u8 opens;  // a TCP SYN without ACK: the first packet of a connection
	__u8 link_ctl;      // enum link_ctl: IPv6 control that stays on the link (see parse_ipv6)
	__u8 is_icmp_error; // an ICMP error, quoting a datagram at quote_off
	__u16 quote_off;    // from the start of the frame; at most PULL_LEN + 8
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

// The first 8 bytes of the quoted datagram's transport header, where
// TCP, UDP and SCTP keep their ports and ICMP its echo identifier.
struct quoted_l4 {
	__be16 sport; // ICMP: type and code
	__be16 dport; // ICMP: checksum
	__be16 id;    // ICMP echo identifier
	__be16 seq;
};

// The first 8 bytes of an IPv6 extension header, which every kind has.
struct ext_hdr {
	__u8 nexthdr;
	__u8 hdrlen;
	__be16 frag_off; // fragment header only
	__be32 frag_id;  // fragment header only
};

// is_zero is 1 when x (below 2^31) is 0, else 0, without a branch.
static __always_inline __u32 is_zero(__u32 x)
{
	return (x - 1) >> 31;
}

// is_link_local6: fe80::/10.
static __always_inline int is_link_local6(const __u8 *a)
{
	return a[0] == 0xfe && (a[1] & 0xc0) == 0x80;
}

// is_unspecified6: ::, the source of duplicate address detection.
static __always_inline int is_unspecified6(const __u8 *a)
{
	const __u32 *w = (const __u32 *)a;
	return (w[0] | w[1] | w[2] | w[3]) == 0;
}

static __always_inline int is_echo(__u8 type)
{
	return type == 8 || type == 0 || type == 128 || type == 129;
}

// is_icmp_error: destination unreachable (which includes "fragmentation
// needed"), time exceeded and parameter problem for ICMP; the same and
// "packet too big" for ICMPv6.
static __always_inline int is_icmp_error(__u8 proto, __u8 type)
{
	if (proto == IPPROTO_ICMP)
		return type == 3 || type == 11 || type == 12;
	return type >= 1 && type <= 4;
}

// quoted_ports reads the quoted transport header's ports; it returns 0 when
// the quoted datagram cannot belong to a tracked flow.
static __always_inline int quoted_ports(struct quoted_l4 *q, void *end, struct quoted *qd)
{
	if ((void *)(q + 1) > end)
		return 0;
	switch (qd->proto) {
	case IPPROTO_TCP:
	case IPPROTO_UDP:
	case IPPROTO_SCTP:
		qd->sport = bpf_ntohs(q->sport);
		qd->dport = bpf_ntohs(q->dport);
		return 1;
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		// Errors are never sent about errors, so only echo is left.
		if (!is_echo(*(__u8 *)q))
			return 0;
		qd->sport = bpf_ntohs(q->id);
		qd->dport = qd->sport;
		return 1;
	}
	return 0;
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

static __always_inline int is_ext_hdr(__u32 next)
{
	return next == IPPROTO_HOPOPTS || next == IPPROTO_ROUTING || next == IPPROTO_DSTOPTS ||
	       next == IPPROTO_FRAGMENT || next == IPPROTO_AH;
}

// Results of walk_ext_hdrs other than an offset.
#define WALK_MALFORMED (-1)
#define WALK_LATER_FRAGMENT (-2)

// walk_ext_hdrs follows the IPv6 extension headers that start off bytes into
// the frame, *next being the first one's type, and returns the offset of the
// upper-layer header, with *next its protocol. A fragment header's kind
// (enum frag_kind) and identification go to *frag and *frag_id, which the
// caller zeroes. A non-first fragment has no upper-layer header: the walk
// stops there with WALK_LATER_FRAGMENT and *next the fragment's protocol.
static __always_inline int walk_ext_hdrs(void *data, void *end, __u32 off, __u32 *next,
					 const int max, __u8 *frag, __u32 *frag_id)
{
	int i;
	for (i = 0; i < max && is_ext_hdr(*next); i++) {
		if (off > PULL_LEN)
			return WALK_MALFORMED;
		struct ext_hdr *h = data + bounded(off);
		if ((void *)(h + 1) > end)
			return WALK_MALFORMED;
		__u32 is_frag = is_zero(*next ^ IPPROTO_FRAGMENT);
		if (is_frag && (h->frag_off & bpf_htons(0xfff8))) {
			*next = h->nexthdr;
			*frag = FRAG_LATER;
			*frag_id = h->frag_id;
			return WALK_LATER_FRAGMENT;
		}
		// A first fragment has the M flag; its identification is kept.
		// Masks, not branches: one path for the verifier to follow.
		*frag |= is_frag & bpf_ntohs(h->frag_off);
		*frag_id = (*frag_id & (is_frag - 1)) | (h->frag_id & -is_frag);
		// The length without a branch per header type, so the verifier
		// follows one path through each iteration instead of three:
		// AH counts 4-byte units less 2, the others 8-byte units less 1,
		// and the fragment header (whose length byte is reserved) is 8.
		__u32 is_ah = is_zero(*next ^ IPPROTO_AH);
		__u32 units = (__u32)h->hdrlen & (is_frag - 1);
		off += (units + 1 + is_ah) << (3 - is_ah);
		*next = h->nexthdr;
	}
	if (i == max && is_ext_hdr(*next))
		return WALK_MALFORMED;
	if (off > PULL_LEN)
		return WALK_MALFORMED;
	return off;
}

// parse_quoted reads the datagram an ICMP error of the given family quotes,
// which starts off bytes into the frame, into qd. It returns 1 only when it
// found a tuple that conntrack could hold: an IPv4 header (options allowed)
// or an IPv6 header (extension headers allowed), not of a later fragment,
// then TCP, UDP, SCTP or ICMP echo, and their ports, all within the first
// PULL_LEN bytes of the frame. Anything else leaves the error to be judged
// as a flow of its own.
static __always_inline int parse_quoted(void *data, __u32 off, void *end, const int family,
					struct quoted *qd)
{
	if (family == 4) {
		struct iphdr *ip = data + bounded(off);
		if ((void *)(ip + 1) > end || ip->version != 4 || ip->ihl < 5)
			return 0;
		if (ip->frag_off & bpf_htons(0x1fff))
			return 0;
		qd->proto = ip->protocol;
		qd->src.v4 = ip->saddr;
		qd->dst.v4 = ip->daddr;
		return quoted_ports((void *)ip + ip->ihl * 4, end, qd);
	}
	struct ipv6hdr *ip6 = data + bounded(off);
	if ((void *)(ip6 + 1) > end || ip6->version != 6)
		return 0;
	__u32 next = ip6->nexthdr;
	__u8 frag = FRAG_NONE;
	__u32 frag_id = 0;
	int l4_off = walk_ext_hdrs(data, end, off + sizeof(*ip6), &next, MAX_QUOTED_EXT_HDRS, &frag, &frag_id);
	if (l4_off < 0)
		return 0;
	qd->proto = next;
	__builtin_memcpy(qd->src.v6, &ip6->saddr, 16);
	__builtin_memcpy(qd->dst.v6, &ip6->daddr, 16);
	return quoted_ports(data + bounded(l4_off), end, qd);
}

// parse_l4 reads ports at l4, which is l4_off bytes into the frame. A non-first fragment carries no L4 header: its
// ports stay 0, so only rules without a port restriction can allow it.
static __always_inline int parse_l4(void *l4, __u32 l4_off, void *end, struct flow *f,
				    int first_fragment)
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
		// Router and neighbour solicitation and advertisement, and
		// redirect (RFC 4861); multicast listener messages (RFC 2710,
		// RFC 3810). parse_ipv6 also checks where they are sent.
		if (f->family == 6 && f->proto == IPPROTO_ICMPV6) {
			if (e->type >= 133 && e->type <= 137)
				f->link_ctl = LINK_ND;
			else if ((e->type >= 130 && e->type <= 132) || e->type == 143)
				f->link_ctl = LINK_MLD;
		}
		if (is_echo(e->type)) {
			f->sport = bpf_ntohs(e->id);
			f->dport = f->sport;
		} else if (is_icmp_error(f->proto, e->type)) {
			// Only ICMP in IPv4 and ICMPv6 in IPv6 quote datagrams of
			// their own family, which conntrack could hold. The quote
			// is read only when it is needed (see is_related).
			f->is_icmp_error = (f->proto == IPPROTO_ICMP) == (f->family == 4);
			f->quote_off = l4_off + sizeof(*e);
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
	// MF or an offset makes a fragment (rare: one test on the common path).
	if (ip->frag_off & bpf_htons(0x3fff)) {
		f->frag = (ip->frag_off & bpf_htons(0x1fff)) ? FRAG_LATER : FRAG_FIRST;
		f->frag_id = ip->id;
	}
	return parse_l4(l4, sizeof(struct ethhdr) + ip->ihl * 4, end, f, !(ip->frag_off & bpf_htons(0x1fff)));
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
	int off = sizeof(struct ethhdr) + sizeof(*ip6);
	// Most packets have no extension header: they skip the walk.
	if (is_ext_hdr(next)) {
		// parse zeroed f->frag and f->frag_id.
		off = walk_ext_hdrs(data, end, off, &next, MAX_EXT_HDRS, &f->frag, &f->frag_id);
		if (off == WALK_MALFORMED)
			return PARSE_MALFORMED;
		// A non-first fragment has no upper-layer header to read: its
		// ports stay 0.
		if (off == WALK_LATER_FRAGMENT) {
			f->proto = next;
			return PARSE_OK;
		}
	}
	f->proto = next;

	void *l4 = data + bounded(off);
	if (l4 > end)
		return PARSE_MALFORMED;
	int r = parse_l4(l4, off, end, f, 1);
	// Neighbour discovery is IPv6's ARP: without it a pod cannot reach its
	// gateway at all, whatever the policy. A hop limit of 255 proves that
	// it was sent on this link (RFC 4861 7.1.1), so nothing from beyond
	// the node can pass as such.
	if (f->link_ctl == LINK_ND && ip6->hop_limit != 255)
		f->link_ctl = LINK_NONE;
	// A pod's kernel reports the groups it listens to (MLD) as soon as an
	// interface is up. Such a message carries no data, is sent from the
	// link-local or the unspecified address to a link-scope group with a
	// hop limit of 1 (RFC 3810 5, 7.4), and so reaches the node's veth and
	// nothing further: judged as a flow it is only noise in the deny
	// counts. Anything else with an MLD type is judged like any packet.
	if (f->link_ctl == LINK_MLD &&
	    !(ip6->hop_limit == 1 && f->dst.v6[0] == 0xff && f->dst.v6[1] == 0x02 &&
	      (is_link_local6(f->src.v6) || is_unspecified6(f->src.v6))))
		f->link_ctl = LINK_NONE;
	return r;
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
	f->is_icmp_error = 0;
	f->link_ctl = LINK_NONE;
	f->frag = FRAG_NONE;
	f->frag_id = 0;

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
