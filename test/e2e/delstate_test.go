package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/podfence/podfence/pkg/pinpath"
)

// TestDelFailsWhenStateUnreadable: a DEL that cannot read the membership
// store must fail (104), not report "nothing recorded": the record may be
// there, and with it attachments that would leak. The plugin runs without
// the capabilities that let root ignore file modes, and the members
// directory it must search is mode 0.
func TestDelFailsWhenStateUnreadable(t *testing.T) {
	c := lcCluster(t, attachModes(t)[0])
	p := c.addPod(webReplicas[0], "default")
	ifindex := lcIfindex(t, c, p.hostVeth)

	// Without DAC override root is bound by modes like anyone else.
	wrapper := filepath.Join(t.TempDir(), "podfence-nodac")
	script := fmt.Sprintf("#!/bin/sh\nexec setpriv --bounding-set=-dac_override,-dac_read_search %s \"$@\"\n", filepath.Join(binDir, "podfence"))
	if err := os.WriteFile(wrapper, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	members := pinpath.Root(c.pinRoot).Members(lcIdentifier(t, p))
	if err := os.Chmod(members, 0); err != nil {
		t.Fatal(err)
	}
	restore := func() {
		if err := os.Chmod(members, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	defer func() { _ = os.Chmod(members, 0o700) }()

	// No Kubernetes arguments: DEL must search the store for the container.
	del := lcCall{cmd: "DEL", containerID: p.containerID, ifname: "eth0", conf: lcConf(c, "1.0.0"), plugin: wrapper}
	_, err := lcExec(t, c, del)
	lcWantCNIError(t, err, 104, "permission denied")
	restore()
	lcRequireEnforced(t, c, p)
	if in, eg := lcAttached(t, c, ifindex); len(in) == 0 || len(eg) == 0 {
		t.Fatalf("a failed DEL detached programs: ingress %v egress %v", in, eg)
	}

	// With the store readable again the same DEL finds and removes it.
	del.plugin = ""
	if _, err := lcExec(t, c, del); err != nil {
		t.Fatalf("DEL with the store readable: %v", err)
	}
	lcRequireGone(t, c, p)
}
