package bpf

// The generated objects are committed so that `go build` needs no clang;
// `make generate` runs this and `make lint` checks the result is unchanged.
// The little-endian object serves amd64 and arm64 alike; hack/bpf2go.sh
// finds the build machine's kernel headers for either.
//go:generate ../hack/bpf2go.sh podfence podfence.c -type id_state -type port_range -type policy_value -type port_set -type lpm_key_v4 -type lpm_key_v6 -type ct_key_v4 -type ct_key_v6 -type ct_value -type cached_time -type deny_event -type pod_sources -type tier_key -type tier_value -type tier_slot -type service_key
