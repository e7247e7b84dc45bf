// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
// The time that conntrack entries and deny events record, shared by the
// datapath and bpf/bound.
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "types.h"

// The per-CPU cache of now_ns, pinned once per node with the global maps.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct cached_time);
} tick_clock SEC(".maps");

// coarse_clock is set by the loader where bpf_ktime_get_coarse_ns exists
// (Linux >= 5.11). Reading the precise clock costs about as much as the rest
// of a conntrack hit, and last_seen needs no better than tick resolution;
// 5.10 falls back to the precise clock. Both are CLOCK_MONOTONIC.
volatile const __u32 coarse_clock = 0;

// now_ns is the CLOCK_MONOTONIC time that last_seen and deny events record,
// read once per jiffy and CPU. Even the coarse clock is a helper call, a
// tenth of a conntrack hit, while bpf_jiffies64 is one load the verifier
// inlines (5.6+), and the coarse clock only moves when jiffies do. The value
// lags the coarse clock by at most one more tick: the tick advances jiffies
// just before it advances the clock.
static __always_inline __u64 now_ns(void)
{
	__u32 zero = 0;
	struct cached_time *c = bpf_map_lookup_elem(&tick_clock, &zero);
	__u64 j = bpf_jiffies64();
	if (c && c->jiffies == j && c->ns)
		return c->ns;
	__u64 ns = coarse_clock ? bpf_ktime_get_coarse_ns() : bpf_ktime_get_ns();
	if (c) {
		// ns first: a program that interrupted this one between the two
		// stores sees the old jiffy and reads the clock itself.
		c->ns = ns;
		c->jiffies = j;
	}
	return ns;
}
