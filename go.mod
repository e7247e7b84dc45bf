module github.com/podfence/podfence

go 1.26.8

require (
	github.com/cilium/ebpf v0.22.0
	github.com/containernetworking/plugins v1.10.0
	github.com/vishvananda/netlink v1.3.1
	golang.org/x/sys v0.50.0
	sigs.k8s.io/yaml v1.6.0
)

require (
	github.com/containernetworking/cni v1.3.1 // indirect
	github.com/vishvananda/netns v0.0.5 // indirect
	go.yaml.in/yaml/v2 v2.4.2 // indirect
)

tool github.com/cilium/ebpf/cmd/bpf2go
