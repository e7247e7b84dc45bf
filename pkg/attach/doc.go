// Package attach puts a podfence TC program on a TC hook of a pod's host-side
// veth and takes it off again.
//
// Two mechanisms are supported. TCX (Linux 6.6 and later) attaches the
// program through a bpf_link that is pinned on bpffs, so the attachment
// outlives the CNI plugin process that made it. Older kernels (the 5.10 and
// 6.1 kernels of EKS nodes) get the legacy path: a clsact qdisc and a cls_bpf
// filter in direct-action mode, at a priority and handle that podfence owns,
// added over rtnetlink. Either way, podfence's program returns TC_ACT_UNSPEC
// (TCX_NEXT) to allow, so other programs and filters on the hook still run,
// and podfence never removes attachments it did not make.
//
// Every function acts in the network namespace of the calling OS thread.
// Callers that switch namespaces must lock the thread first (as
// ns.WithNetNSPath does).
package attach
