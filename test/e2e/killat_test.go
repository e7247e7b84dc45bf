package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
)

// execKilledAtSyscall runs inv under strace, which kills it with SIGKILL as
// it enters the first syscall of the set that names path: a kill at an
// exact instant that a random delay hits only by luck. It reports whether
// the kill happened; the test skips without strace.
func (c *cluster) execKilledAtSyscall(t *testing.T, inv invocation, syscalls, path string) bool {
	t.Helper()
	straceBin, err := exec.LookPath("strace")
	if err != nil {
		t.Skip("needs strace to kill the plugin at a given syscall")
	}
	ctx, cancel := context.WithTimeout(context.Background(), execTimeout)
	defer cancel()
	cmd, out := c.command(ctx, inv)
	args := []string{"-f", "-qq", "-o", "/dev/null", "-P", path,
		"-e", "trace=" + syscalls, "-e", "inject=" + syscalls + ":signal=KILL", "--", cmd.Path}
	traced := exec.CommandContext(ctx, straceBin, args...)
	traced.Env, traced.Stdin, traced.Stdout, traced.Stderr = cmd.Env, cmd.Stdin, out, out
	err = c.inNode(traced.Run)
	// strace ends the way its tracee did.
	if ws, ok := traced.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL {
		return true
	}
	if err != nil {
		t.Fatalf("%s under strace: %v: %s", inv, err, bytes.TrimSpace(out.Bytes()))
	}
	return false
}

// TestAddKilledWhileRecording kills an ADD while it writes the member's
// record (a window of microseconds, which TestKilledMidway's random delays
// rarely hit), next to a replica that stays, and converges as a runtime
// does: with the DEL that containerd sends after a failed ADD, or with a
// GC. It catches a DEL or GC that leaves the half-made member directory
// behind (empty, or holding the record's temporary "record~new"): nothing
// else removes it while other replicas keep the identifier.
func TestAddKilledWhileRecording(t *testing.T) {
	for _, at := range []struct {
		name, syscalls string
	}{
		{"symlink", "symlinkat,symlink"},        // the member directory is made, empty
		{"rename", "renameat,renameat2,rename"}, // record~new is written, not yet renamed
	} {
		for _, converge := range []string{"DEL", "GC"} {
			t.Run(at.name+"/"+converge, func(t *testing.T) {
				c := newCluster(t, "tc")
				slots := c.newSlots(2)
				c.writePolicy("web", selectPolicy(webReplicas[0]))
				id := podid.ID(webID)
				stays := invocation{command: "ADD", containerID: "ctr-stays", pod: webReplicas[0], slot: slots[0]}
				if err := c.exec(stays); err != nil {
					t.Fatal(err)
				}
				killed := invocation{command: "ADD", containerID: "ctr-killed", pod: webReplicas[1], slot: slots[1]}
				path := filepath.Join(pinpath.Root(c.pinRoot).Member(podid.ID(webID), membership.Key(killed.containerID, "eth0")), pinpath.RecordTemp)
				if !c.execKilledAtSyscall(t, killed, at.syscalls, path) {
					t.Fatalf("%s was not killed at %s of %s", killed, at.syscalls, path)
				}
				// Nothing may be attached before the record is in place.
				c.checkReachable(t, "after killing "+killed.String()+" at "+at.name, slots)
				exp := newExpected(slots)
				exp.join(id, stays.containerID, slots[0])
				exp.gone[killed.containerID] = true
				conv := invocation{command: "DEL", containerID: killed.containerID, pod: killed.pod, slot: killed.slot}
				if converge == "GC" {
					conv = invocation{command: "GC", valid: exp.validAttachments()}
				}
				if err := c.exec(conv); err != nil {
					t.Fatal(err)
				}
				c.check(t, fmt.Sprintf("after the %s that follows an ADD killed at %s", converge, at.name), exp)
			})
		}
	}
}
