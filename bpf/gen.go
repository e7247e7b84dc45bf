package bpf

// The generated objects are committed so that `go build` needs no clang;
// `make generate` runs this and `make lint` checks the result is unchanged.
//go:generate go tool bpf2go -tags linux -target bpfel -cc clang -cflags "-O2 -g -Wall -Werror -mcpu=v3 -I/usr/include/x86_64-linux-gnu" -type id_state -type port_range -type policy_value -type port_set -type lpm_key_v4 -type lpm_key_v6 -type ct_key_v4 -type ct_key_v6 -type ct_value -type cached_time podfence podfence.c
