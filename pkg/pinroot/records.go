package pinroot

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/attach"
	"github.com/podfence/podfence/pkg/pinpath"
)

// The node's records beside the identifiers: STATUS's verified builds and
// the TCX probe's answer (in pinpath.StatusDir), the policy status
// (policy.go), the DELs' tombstones (membership), and the removal of all of
// it when podfence leaves the node.

// TCXProbe is the record of whether this boot's kernel attaches TCX links
// (attach.TCXRecord), which the plugin's first ADD of a boot probes.
func (n *Root) TCXProbe() attach.TCXRecord {
	return attach.TCXRecord(pinpath.Root(n.path).TCXProbe())
}

// VerifyDatapath reports whether the pin root is writable and this build's
// datapath loads on this kernel (bpf.CheckLoad), done once per build and
// kernel: runtimes poll STATUS, and a load costs the verifier's time on
// every call. A success leaves a marker in the status directory named by
// the datapath object and the kernel's release and version; bpffs is
// memory, so a reboot (a new kernel) clears it. It reports whether the
// marker spared the load.
func (n *Root) VerifyDatapath() (cached bool, err error) {
	probe, err := os.MkdirTemp(n.path, "status-probe-")
	if err != nil {
		return false, fmt.Errorf("pin root %s is not writable: %w", n.path, err)
	}
	if err := os.Remove(probe); err != nil {
		return false, fmt.Errorf("pin root %s: %w", n.path, err)
	}
	marker, err := n.verifiedMarker()
	if err != nil {
		return false, err
	}
	if _, err := os.Stat(marker); err == nil {
		return true, nil
	}
	if err := bpf.CheckLoad(); err != nil {
		return false, err
	}
	// A failure to leave the marker costs the next call a load, no more.
	_ = os.MkdirAll(marker, 0o700)
	return false, nil
}

// verifiedMarker is the status directory's marker of this build on this
// kernel.
func (n *Root) verifiedMarker() (string, error) {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return "", fmt.Errorf("uname: %w", err)
	}
	h := sha256.New()
	h.Write([]byte(bpf.ObjectID()))
	h.Write(u.Release[:])
	h.Write(u.Version[:])
	return filepath.Join(pinpath.Root(n.path).Status(), fmt.Sprintf("verified-%x", h.Sum(nil)[:12])), nil
}

// Remove removes the node-wide pins (the global maps, the status
// directory, the DELs' tombstones, the policy error) and then the pin root
// itself, once RemoveAll has emptied its identifiers: for a node podfence
// leaves (loaded programs hold their maps). Without the global layout
// marker (not a pin root of podfence's, or one already removed) it removes
// nothing but empty directories, so a wrong root loses nothing of
// another's; a root that still holds something else stays, and the error
// says so.
func (n *Root) Remove() error {
	if err := n.Close(); err != nil {
		return fmt.Errorf("remove node pins: %w", err)
	}
	r := pinpath.Root(n.path)
	_, err := os.Lstat(filepath.Join(r.Global(), pinpath.Layout))
	switch {
	case errors.Is(err, os.ErrNotExist):
		// No global pins of podfence's here: only empty directories go.
		for _, p := range []string{r.Identifiers(), n.path} {
			if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("remove node pins: %s has no layout marker of podfence's; %w", r.Global(), err)
			}
		}
		return nil
	case err != nil:
		return fmt.Errorf("remove node pins: %w", err)
	}
	for _, dir := range []string{r.Global(), r.Status(), r.Tombstones()} {
		if err := os.RemoveAll(dir); err != nil {
			return fmt.Errorf("remove node pins: %w", err)
		}
	}
	// A policy error record's temporary name too, left by a writer
	// killed halfway (under this build's name or the one before).
	for _, p := range []string{r.PolicyError(), filepath.Join(n.path, pinpath.PolicyErrorTemp),
		filepath.Join(n.path, pinpath.PolicyErrorTempV2), r.Identifiers(), n.path} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove node pins: %w", err)
		}
	}
	return nil
}
