package bound

// Generated like ../gen.go: the object is committed, `make generate`
// rebuilds it and `make lint` checks it is unchanged.
//go:generate ../../hack/bpf2go.sh bound bound.c
