// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//
// Judging a pod's egress after Service translation (README, "Judging egress
// after Service translation"). The pod's veth sees a Service's frontend (a
// ClusterIP, say), which kube-proxy translates to a backend only after the
// veth's TC ingress. So a new flow from an egress-isolated pod to a
// frontend in the services map is not judged at the veth: its program
// stamps the identifier's slot in the packet's mark and lets it pass.
// Where the packet leaves (the backend pod's veth, whose ingress program
// checks the mark first, or an uplink's uplink_after_nat), the slot's
// judge, pod_after_nat, reached by a tail call so that it reads its own
// identifier's maps, finds in the kernel's conntrack entry the tuple the
// pod sent and the backend it was translated to, judges the flow on the
// backend and tracks it under the tuple the veth sees.
//
// A packet delivered to a socket of the node meets no TC egress: there the
// judge is pod_local, a cgroup_skb program, reached from local_after_nat at
// the ingress of the cgroup that holds the node's sockets.
//
// Kernel facilities: skb marks, which survive the routing between the two
// hooks (a pod cannot set them: the veth scrubs a packet crossing into the
// node's namespace); TC egress on the output device; cgroup_skb ingress;
// tail calls; and the
// conntrack kfuncs bpf_skb_ct_lookup and bpf_ct_release (5.18 and later;
// nf_conntrack's BTF). Where the kernel lacks the kfuncs the loader leaves
// after_nat 0 and a Service is judged at the veth on its frontend, as
// before (5.10).
#pragma once

#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>

#include "types.h"
#include "parse.h"
#include "conntrack.h"

// ---- Global maps, pinned once per node ----

// The frontends kube-proxy translates on this node; the sweeper writes them
// (ClusterIPs, external and load-balancer IPs, NodePorts on each node
// address). The value is unused: presence is the answer.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 65536);
	__type(key, struct service_key);
	__type(value, __u8);
} services SEC(".maps");

// The mark carries slot + 1 in SLOT_MASK's 11 bits (0: nothing to judge):
// kube-proxy owns 0x4000 and 0x8000, the VPC CNI 0x80, all below.
#define SLOT_SHIFT 16
#define SLOT_MASK (0x7ffu << SLOT_SHIFT)
#define MAX_SLOTS 2047

// The programs of the node's identifiers by slot s: its pod_after_nat at
// 2s, its pod_ingress at 2s + 1 (where pod_after_nat goes on to, at the
// backend's veth, once the egress judgement allows).
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 2 * (MAX_SLOTS + 1));
	__type(key, __u32);
	__type(value, __u32);
} judges SEC(".maps");

// The node's sockets have no TC egress: local_after_nat, at the ingress of
// a cgroup that holds them (the sweeper's --judge-local-cgroup), hands a
// stamped packet delivered there to its sender's pod_local, by slot. A
// program array holds one program type, so these are apart from judges.
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, MAX_SLOTS + 1);
	__type(key, __u32);
	__type(value, __u32);
} local_judges SEC(".maps");

// Set by the loader: the identifier's slot, and whether its judge is
// installed there (after_nat: the kernel has the conntrack kfuncs and the
// identifier a slot); dispatch, whether its ingress program hands stamped
// packets to their senders' judges (the kernel has the kfuncs, so other
// identifiers' veths may stamp, whether this one has a slot or not).
volatile const __u32 slot = 0;
volatile const __u8 after_nat = 0;
volatile const __u8 dispatch = 0;

// What a tail call into pod_after_nat passes in skb->cb, which survives it.
#define CB_NEXT 0 // 1 + the judges index to go on to once allowed; 0: none
#define CB_MODE 1 // enum judge_mode

// What the judge writes in cb[CB_MODE] and cb[CB_NEXT] when it hands a
// packet back to its pod's ingress program as a new flow (MODE_VETH_FIRST
// found no flow the pod opened): two words, so that what an earlier layer
// left in cb cannot pass for them.
#define CB_NEW_FLOW_0 0x50460a11u
#define CB_NEW_FLOW_1 0xafb9f5eeu

enum judge_mode {
	// At the device the packet leaves by, after the translation: a new
	// flow the veth stamped.
	MODE_OUTPUT = 0,
	// At the pod's veth, a tracked Service flow of a stale generation,
	// in the direction the pod opened it, or a reply.
	MODE_VETH_FORWARD = 1,
	MODE_VETH_REPLY = 2,
	// At the pod's veth, a packet from a frontend that nothing tracked:
	// the first reply of a flow no judge tracked (delivered to a socket of
	// the node, which has no TC egress; its entry evicted; no uplink
	// hook), or a new flow from the frontend's address and port, which
	// the kernel's entry tells apart.
	MODE_VETH_FIRST = 3,
};

static __always_inline void stamp(struct __sk_buff *skb)
{
	volatile __u32 *mark = &skb->mark;
	*mark = (*mark & ~SLOT_MASK) | ((slot + 1) << SLOT_SHIFT);
}

// stamped is the slot + 1 a veth stamped, 0 for anything else.
static __always_inline __u32 stamped(struct __sk_buff *skb)
{
	volatile __u32 *mark = &skb->mark;
	return (*mark & SLOT_MASK) >> SLOT_SHIFT;
}

static __always_inline void unstamp(struct __sk_buff *skb)
{
	volatile __u32 *mark = &skb->mark;
	*mark &= ~SLOT_MASK;
}

// is_frontend reports whether addr:port/proto (addr in network order, 4
// or 16 bytes) is a frontend of the services map.
static __always_inline int is_frontend(const int family, const union ip_addr *addr, __u16 port, __u8 proto)
{
	struct service_key k = {.port = port, .proto = proto};
	if (family == 4) {
		k.addr[10] = 0xff;
		k.addr[11] = 0xff;
		__builtin_memcpy(&k.addr[12], &addr->v4, 4);
	} else {
		__builtin_memcpy(k.addr, addr->v6, 16);
	}
	return bpf_map_lookup_elem(&services, &k) != 0;
}

// is_service reports whether the packet f goes to a frontend.
static __always_inline int is_service(const int family, const struct flow *f)
{
	return is_frontend(family, &f->dst, f->dport, f->proto);
}

// A Service flow as the kernel's conntrack entry has it: what the pod sent
// (src, dst: the frontend, ports) and the backend it was translated to.
// Addresses in network order (IPv4 in the first 4 bytes), ports in host order.
struct translation {
	union ip_addr src, dst, backend;
	__u16 sport, dport, backend_port;
};

static __always_inline void read_addr(union ip_addr *to, const struct nf_conntrack_man___pf *m, const int family)
{
	if (family == 4) {
		to->v4 = m->u3.ip;
		return;
	}
	__be32 *w = (__be32 *)to->v6;
	w[0] = m->u3.ip6[0];
	w[1] = m->u3.ip6[1];
	w[2] = m->u3.ip6[2];
	w[3] = m->u3.ip6[3];
}

// translated fills t from the conntrack entry of the packet f: looked up
// by the packet's own tuple when it travels as the pod sent it, before the
// translation (forward), else by the reversed one (after the translation,
// the reversed tuple is the entry's reply tuple; a reply at the veth, back
// through the reverse translation, is the original reversed). 0 when the
// kernel has no kfunc or no entry, or for a protocol the lookup does not
// take (only TCP and UDP).
static __always_inline int translated(struct __sk_buff *skb, const int family, const struct flow *f,
				      int forward, struct translation *t)
{
	// The loader sets after_nat only where the kfuncs exist, and the
	// verifier drops what follows elsewhere (the calls, weak, are
	// poisoned there). Not a test of the kfunc's address: an ld_imm64 of
	// a kfunc is refused before 6.3 ("uses reserved fields" on 6.1).
	if (!after_nat)
		return 0;
	if (f->proto != IPPROTO_TCP && f->proto != IPPROTO_UDP)
		return 0;
	const union ip_addr *a = forward ? &f->src : &f->dst;
	const union ip_addr *b = forward ? &f->dst : &f->src;
	__u16 pa = forward ? f->sport : f->dport;
	__u16 pb = forward ? f->dport : f->sport;
	struct bpf_sock_tuple tu = {};
	__u32 len;
	if (family == 4) {
		tu.ipv4.saddr = a->v4;
		tu.ipv4.daddr = b->v4;
		tu.ipv4.sport = bpf_htons(pa);
		tu.ipv4.dport = bpf_htons(pb);
		len = sizeof(tu.ipv4);
	} else {
		__builtin_memcpy(tu.ipv6.saddr, a->v6, 16);
		__builtin_memcpy(tu.ipv6.daddr, b->v6, 16);
		tu.ipv6.sport = bpf_htons(pa);
		tu.ipv6.dport = bpf_htons(pb);
		len = sizeof(tu.ipv6);
	}
	struct bpf_ct_opts___pf o = {.netns_id = CT_OPTS_CURRENT_NETNS, .l4proto = f->proto};
	struct nf_conn *ct = bpf_skb_ct_lookup(skb, &tu, len, &o, sizeof(o));
	if (!ct)
		return 0;
	read_addr(&t->src, &ct->tuplehash[0].tuple.src, family);
	read_addr(&t->dst, &ct->tuplehash[0].tuple.dst, family);
	read_addr(&t->backend, &ct->tuplehash[1].tuple.src, family);
	t->sport = bpf_ntohs(ct->tuplehash[0].tuple.src.u.all);
	t->dport = bpf_ntohs(ct->tuplehash[0].tuple.dst.u.all);
	t->backend_port = bpf_ntohs(ct->tuplehash[1].tuple.src.u.all);
	bpf_ct_release(ct);
	return 1;
}

// parse_delivered reads what the judge of a packet delivered to a socket of
// the node needs (family, addresses, protocol, ports) from skb, whose data
// starts at the IP header there (cgroup_skb). The stack has reassembled
// fragments. Only TCP and UDP, which are all the veth stamps, and no IPv6
// extension headers: anything else is PARSE_MALFORMED, dropped.
static __always_inline int parse_delivered(struct __sk_buff *skb, struct flow *f)
{
	__builtin_memset(f, 0, sizeof(*f));
	__u32 l4;
	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		struct iphdr ip;
		if (bpf_skb_load_bytes(skb, 0, &ip, sizeof(ip)) < 0 || ip.ihl < 5)
			return PARSE_MALFORMED;
		f->family = 4;
		f->proto = ip.protocol;
		f->src.v4 = ip.saddr;
		f->dst.v4 = ip.daddr;
		l4 = ip.ihl * 4;
	} else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr ip6;
		if (bpf_skb_load_bytes(skb, 0, &ip6, sizeof(ip6)) < 0)
			return PARSE_MALFORMED;
		f->family = 6;
		f->proto = ip6.nexthdr;
		__builtin_memcpy(f->src.v6, &ip6.saddr, 16);
		__builtin_memcpy(f->dst.v6, &ip6.daddr, 16);
		l4 = sizeof(ip6);
	} else {
		return PARSE_MALFORMED;
	}
	if (f->proto != IPPROTO_TCP && f->proto != IPPROTO_UDP)
		return PARSE_MALFORMED;
	struct l4_ports p;
	if (bpf_skb_load_bytes(skb, l4, &p, sizeof(p)) < 0)
		return PARSE_MALFORMED;
	f->sport = bpf_ntohs(p.sport);
	f->dport = bpf_ntohs(p.dport);
	return PARSE_OK;
}
