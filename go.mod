module github.com/podfence/podfence

go 1.26.8

require (
	github.com/cilium/ebpf v0.22.0
	sigs.k8s.io/yaml v1.6.0
)

require (
	github.com/containernetworking/plugins v1.10.0 // indirect
	github.com/vishvananda/netlink v1.3.1 // indirect
	github.com/vishvananda/netns v0.0.5 // indirect
	go.yaml.in/yaml/v2 v2.4.2 // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
	golang.org/x/sync v0.24.0 // indirect
	golang.org/x/sys v0.50.0 // indirect
)

tool github.com/cilium/ebpf/cmd/bpf2go
