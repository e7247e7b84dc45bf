// Package podid derives the pod identifier: the name under which the replicas
// of one workload on a node share pinned eBPF programs and maps.
//
// The identifier is built from K8S_POD_NAME and K8S_POD_NAMESPACE (or the
// container ID when a runtime passes no Kubernetes arguments), validated
// before it can reach a path, and encoded so that bpffs accepts it: '.' is
// refused by bpffs and becomes '_', which Kubernetes names cannot contain.
package podid
