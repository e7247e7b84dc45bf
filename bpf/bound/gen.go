package bound

// Generated like ../gen.go: the object is committed, `make generate`
// rebuilds it and `make lint` checks it is unchanged.
//go:generate go tool bpf2go -tags linux -target bpfel -cc clang -cflags "-O2 -g -Wall -Werror -mcpu=v3 -I/usr/include/x86_64-linux-gnu" bound bound.c
