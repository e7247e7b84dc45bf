// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
// The map definitions that bpf/bound shares with the datapath, so that its
// lower bound is measured on maps of the same type, layout and size.
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "types.h"

#define CT_V4_ENTRIES 131072
#define CT_V6_ENTRIES 65536
#define POLICY_TRIE_ENTRIES 16384
// Members of one identifier on one node (its sources map).
#define MAX_MEMBERS 1024

// A global conntrack map: one per family, pinned once per node.
#define CT_MAP(name, keytype, entries)                                                             \
	struct {                                                                                   \
		__uint(type, BPF_MAP_TYPE_LRU_HASH);                                               \
		__uint(max_entries, entries);                                                      \
		__type(key, keytype);                                                              \
		__type(value, struct ct_value);                                                    \
	} name SEC(".maps")

// Entries of an identifier's tiers trie: the prefixes of its cluster rules
// and the node's addresses.
#define TIER_TRIE_ENTRIES 4096

// A policy trie: one per identifier, direction and family.
#define POLICY_TRIE(name, keytype)                                                                 \
	struct {                                                                                   \
		__uint(type, BPF_MAP_TYPE_LPM_TRIE);                                               \
		__uint(map_flags, BPF_F_NO_PREALLOC);                                              \
		__uint(max_entries, POLICY_TRIE_ENTRIES);                                          \
		__type(key, keytype);                                                              \
		__type(value, struct policy_value);                                                \
	} name SEC(".maps")

// An identifier's state: one entry, its policy generation and isolation.
#define STATE_MAP(name)                                                                            \
	struct {                                                                                   \
		__uint(type, BPF_MAP_TYPE_ARRAY);                                                  \
		__uint(max_entries, 1);                                                            \
		__type(key, __u32);                                                                \
		__type(value, struct id_state);                                                    \
	} name SEC(".maps")
