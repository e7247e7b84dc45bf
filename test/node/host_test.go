package node

import "testing"

func TestNodeCgroup(t *testing.T) {
	for path, want := range map[string]bool{
		"/sys/fs/cgroup/memory/process_api/eb4bc3da459c79f7881316ae0fb5decb":                 false, // another process's
		"/sys/fs/cgroup/unified/default":                                                     false,
		"/sys/fs/cgroup/memory/process_api/7930aedd/podfence-node-4242":                      true,
		"/sys/fs/cgroup/memory/kubepods/besteffort":                                          true, // a kubelet outside its root
		"/sys/fs/cgroup/cpu/kubepods.slice":                                                  true,
		"/sys/fs/cgroup/pids/pod6f1c2a7e-5b7d-4c1e-9a55-2f0e8c1d3b4a":                        true,
		"/sys/fs/cgroup/memory/k8s.io/4b1f":                                                  true, // containerd's namespace
		"/sys/fs/cgroup/systemd/system.slice/containerd.service":                             true,
		"/sys/fs/cgroup/memory/process_api/7930aedd/podfence-node-4242/kubepods/burstable/x": true,
	} {
		if got := nodeCgroup.MatchString(path); got != want {
			t.Errorf("%s: node's %v, want %v", path, got, want)
		}
	}
}
