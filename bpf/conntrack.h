// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//
// The kernel's conntrack entries as BPF programs read them: the conntrack
// kfuncs (5.18 and later, with nf_conntrack's BTF) and the few fields of
// struct nf_conn that podfence reads, relocated against the running
// kernel's types (CO-RE). service.h judges Service flows with them;
// bound/bound.c measured the designs with them.
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

// Only the fields read, relocated against the kernel's types (CO-RE, which
// matches members by name: one local type serves for the tuple's src, an
// nf_conntrack_man, and its anonymous dst).
struct nf_conntrack_man___pf {
	union {
		__be32 ip;
		__be32 ip6[4];
	} u3;
	union {
		__be16 all;
	} u;
} __attribute__((preserve_access_index));
struct nf_conntrack_tuple___pf {
	struct nf_conntrack_man___pf src;
	struct nf_conntrack_man___pf dst;
} __attribute__((preserve_access_index));
struct nf_conntrack_tuple_hash___pf {
	struct nf_conntrack_tuple___pf tuple;
} __attribute__((preserve_access_index));
struct nf_conn {
	struct nf_conntrack_tuple_hash___pf tuplehash[2]; // IP_CT_DIR_ORIGINAL, IP_CT_DIR_REPLY
} __attribute__((preserve_access_index));

struct bpf_ct_opts___pf {
	__s32 netns_id;
	__s32 error;
	__u8 l4proto;
	__u8 dir;
	__u8 reserved[2];
}; // the 12 bytes 5.18 to 6.18 accept (NF_BPF_CT_OPTS_SZ)
#define CT_OPTS_CURRENT_NETNS (-1)

extern struct nf_conn *bpf_skb_ct_lookup(struct __sk_buff *, struct bpf_sock_tuple *, __u32,
					 struct bpf_ct_opts___pf *, __u32) __ksym __weak;
extern void bpf_ct_release(struct nf_conn *) __ksym __weak;

