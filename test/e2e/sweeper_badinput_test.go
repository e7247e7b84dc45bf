package e2e

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/test/kernel"
)

// TestSweeperBadInput: the sweeper's answers to what an operator can get
// wrong. A usage error exits 2, anything else 1, each with a message that
// says what to fix, and none of them changes the node.
func TestSweeperBadInput(t *testing.T) {
	c := lcCluster(t, attachModes(t)[0])
	c.addPod(webReplicas[0], "default")
	notBPF := t.TempDir()
	// Pins of another layout: a conntrack map whose key is not podfence's.
	other := kernel.PinRoot(t)
	if err := os.MkdirAll(pinpath.Root(other).Global(), 0o700); err != nil {
		t.Fatal(err)
	}
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.LRUHash, KeySize: 8, ValueSize: 16, MaxEntries: bpf.DefaultCTv4Entries})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Pin(filepath.Join(pinpath.Root(other).Global(), pinpath.MapCTv4)); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		args []string
		code int
		msg  string
	}{
		{"unknown subcommand", []string{"sweeep"}, 2, "unknown command"},
		{"unknown flag", []string{"sweep", "--pin-root", c.pinRoot, "--graze", "1s"}, 2, "graze"},
		{"flag without a value", []string{"ls", "--pin-root"}, 2, "pin-root"},
		{"missing pin root", []string{"ls", "--pin-root", filepath.Join(notBPF, "nothing")}, 1, "does not exist"},
		{"pin root not on bpffs", []string{"sweep", "--pin-root", notBPF}, 1, "not on bpffs"},
		{"maps of another size", []string{"sweep", "--pin-root", c.pinRoot, "--ct-v4-entries", "2048"}, 1, "2048"},
		{"maps of another layout", []string{"sweep", "--pin-root", other}, 1, pinpath.MapCTv4},
		{"a table size out of range", []string{"sweep", "--pin-root", c.pinRoot, "--ct-v6-entries", "12"}, 2, "--ct-v6-entries"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := c.sweeper(t, tc.args...)
			var exit *exec.ExitError
			if !errors.As(err, &exit) || exit.ExitCode() != tc.code {
				t.Fatalf("podfence-sweeper %v: %v, want exit code %d", tc.args, err, tc.code)
			}
			if !strings.Contains(err.Error(), tc.msg) {
				t.Errorf("message %q does not mention %q", err, tc.msg)
			}
		})
	}
	if entries, _ := os.ReadDir(notBPF); len(entries) != 0 {
		t.Errorf("a refused pin root was written to: %v", entries)
	}
}

// TestSweeperCorruptRecord: a member record the sweeper cannot decode is
// reported by ls and sweep, never a crash, and the pins stay.
func TestSweeperCorruptRecord(t *testing.T) {
	c := lcCluster(t, attachModes(t)[0])
	a := c.addPod(webReplicas[0], "default")
	b := c.addPod(webReplicas[1], "default")
	key := membership.Key(b.containerID, "eth0")
	record := pinpath.Root(c.pinRoot).Record(podid.ID(webID), key)
	if err := os.Remove(record); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("not a member record", record); err != nil {
		t.Fatal(err)
	}

	out, err := c.sweeper(t, "ls", "--json", "--pin-root", c.pinRoot)
	if err != nil {
		t.Fatal(err)
	}
	var ls []struct {
		Identifier string   `json:"identifier"`
		Unreadable []string `json:"unreadable_members"`
	}
	if err := json.Unmarshal(out, &ls); err != nil {
		t.Fatalf("ls --json: %v: %s", err, out)
	}
	if len(ls) != 1 || len(ls[0].Unreadable) != 1 || ls[0].Unreadable[0] != key {
		t.Fatalf("ls reports %+v, want %s unreadable", ls, key)
	}

	r := c.sweep(t, "--orphan-grace", "0")
	if len(r.Orphans) != 0 {
		t.Fatalf("sweep removed %+v beside an unreadable record", r.Orphans)
	}
	if _, err := os.Readlink(record); err != nil {
		t.Fatalf("the unreadable record went: %v", err)
	}
	lcRequireEnforced(t, c, a)
}
