// Not shipped: measures what the two policy sides per identifier (chosen by
// the generation's parity) would cost a packet had they been slots of an
// ARRAY_OF_MAPS, beside referencing a trie directly as the datapath does.
// hack/sides.sh builds and runs it.
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

struct key { __u32 prefixlen; __u8 addr[4]; };

struct trie {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct key);
	__type(value, __u32);
};

struct trie direct SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, 2);
	__type(key, __u32);
	__array(values, struct trie);
} sides SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} state SEC(".maps");

#define LOOKUPS 64

static __always_inline __u32 addr_of(__u32 i) { return 0x0a000000 | (i * 2654435761u >> 8); }

SEC("tc")
int via_direct(struct __sk_buff *skb)
{
	__u32 zero = 0, hits = 0;
	__u32 *st = bpf_map_lookup_elem(&state, &zero);
	if (!st)
		return 0;
	__u32 gen = *(volatile __u32 *)st;
	for (__u32 i = 0; i < LOOKUPS; i++) {
		struct key k = { .prefixlen = 32 };
		__u32 a = bpf_htonl(addr_of(i + gen));
		__builtin_memcpy(k.addr, &a, 4);
		if (bpf_map_lookup_elem(&direct, &k))
			hits++;
	}
	return hits;
}

SEC("tc")
int via_sides(struct __sk_buff *skb)
{
	__u32 zero = 0, hits = 0;
	__u32 *st = bpf_map_lookup_elem(&state, &zero);
	if (!st)
		return 0;
	__u32 gen = *(volatile __u32 *)st;
	__u32 side = gen & 1;
	for (__u32 i = 0; i < LOOKUPS; i++) {
		void *inner = bpf_map_lookup_elem(&sides, &side);
		if (!inner)
			return 0;
		struct key k = { .prefixlen = 32 };
		__u32 a = bpf_htonl(addr_of(i + (gen & ~1u)));
		__builtin_memcpy(k.addr, &a, 4);
		if (bpf_map_lookup_elem(inner, &k))
			hits++;
	}
	return hits;
}

char LICENSE[] SEC("license") = "GPL";
