package bpf

import (
	"errors"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/test/kernel"
)

// TestLoadsWithSweeperCapabilities loads the datapath's programs with only
// the capabilities the sweeper's DaemonSet grants for loading (CAP_BPF,
// CAP_NET_ADMIN and CAP_PERFMON; not CAP_SYS_ADMIN), as its run does when
// it takes a node of an earlier build over and its why does for a trial.
// Without CAP_PERFMON the verifier applies its Spectre mitigations, which
// refuse packet pointer arithmetic with a variable offset (IPv4 options,
// extension headers): found on the real node, where the manifest granted
// only CAP_BPF and CAP_NET_ADMIN and `why` in the sweeper's pod, and the
// programs of its upgrades, were refused.
func TestLoadsWithSweeperCapabilities(t *testing.T) {
	kernel.RequireRoot(t)
	h := newHarness(t)
	done := make(chan error, 1)
	go func() {
		// Capabilities are a thread's: this one keeps the reduced set and
		// ends with the goroutine (never unlocked).
		runtime.LockOSThread()
		if err := keepCapabilities(unix.CAP_BPF, unix.CAP_NET_ADMIN, unix.CAP_PERFMON); err != nil {
			done <- err
			return
		}
		cs, err := loadableSpec()
		if err != nil {
			done <- err
			return
		}
		repl := h.g.replacements()
		for name, m := range h.id.mapFields() {
			repl[name] = *m
		}
		var errs []error
		for _, name := range []string{progIngress, progEgress} {
			p, err := loadProgram(cs, name, repl)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			p.Close()
		}
		done <- errors.Join(errs...)
	}()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// keepCapabilities drops every capability of the calling thread but caps.
func keepCapabilities(caps ...int) error {
	var data [2]unix.CapUserData
	for _, c := range caps {
		data[c/32].Effective |= 1 << (uint(c) % 32)
		data[c/32].Permitted |= 1 << (uint(c) % 32)
	}
	return unix.Capset(&unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}, &data[0])
}
