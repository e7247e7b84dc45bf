package e2e

import (
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/localhook"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/test/kernel"
)

// TestSweeperHooksLocalJudge: `podfence-sweeper run` hooks the judge of
// Service flows delivered to the node's sockets at the cgroup it is told
// (bpf's TestServiceDeliveredOnNodeJudgedOnArrival shows what the judge
// does there); the hook outlives the sweeper, a second sweeper keeps one
// hook, one told none takes it off, and `uninstall` takes it off.
func TestSweeperHooksLocalJudge(t *testing.T) {
	if !bpf.AfterNATSupported() {
		t.Skip("no conntrack kfuncs: nothing is judged after the translation here")
	}
	c := newCluster(t, "tc")
	cg := kernel.Cgroup(t)
	pin := pinpath.Root(c.pinRoot).LocalLink()
	attached := func(want int) []ebpf.ProgramID {
		t.Helper()
		var ids []ebpf.ProgramID
		for deadline := time.Now().Add(3 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			var err error
			if ids, err = localhook.Attached(cg); err != nil {
				t.Fatal(err)
			}
			if len(ids) == want || time.Now().After(deadline) {
				break
			}
		}
		if len(ids) != want {
			t.Fatalf("%d programs at %s's ingress, want %d", len(ids), cg, want)
		}
		return ids
	}
	var first []ebpf.ProgramID
	for round := range 2 {
		cmd, logs := c.runSweeper(t, "--interval-min", "1h", "--interval-max", "1h", "--judge-local-cgroup="+cg)
		logs.waitFor(t, "judged on arrival", 10*time.Second)
		ids := attached(1)
		if round == 0 {
			first = ids
		} else if slices.Equal(ids, first) {
			t.Errorf("the second sweeper's hook runs the first one's program %v, want its own", ids)
		}
		cmd.Process.Kill()
		cmd.Wait()
	}
	// Killed, the sweeper leaves the hook on: the node keeps judging.
	attached(1)
	if _, err := os.Stat(pin); err != nil {
		t.Fatalf("the hook's pin: %v", err)
	}
	// A sweeper told none takes it off, and uninstall finds nothing.
	cmd, _ := c.runSweeper(t, "--interval-min", "1h", "--interval-max", "1h", "--judge-local-cgroup=none")
	c.waitHealthy(t)
	attached(0)
	cmd.Process.Kill()
	cmd.Wait()
	cmd, logs := c.runSweeper(t, "--interval-min", "1h", "--interval-max", "1h", "--judge-local-cgroup="+cg)
	logs.waitFor(t, "judged on arrival", 10*time.Second)
	attached(1)
	cmd.Process.Kill()
	cmd.Wait()
	out, err := c.sweeper(t, "uninstall", "--pin-root", c.pinRoot, "--cni-conf-dir", t.TempDir(), "--cni-bin-dir", t.TempDir())
	if err != nil && !strings.Contains(err.Error(), "conflist") {
		t.Fatalf("uninstall: %v\n%s", err, out)
	}
	attached(0)
	if _, err := os.Stat(pin); !os.IsNotExist(err) {
		t.Errorf("the hook's pin after uninstall: %v", err)
	}
}
