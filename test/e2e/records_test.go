package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
)

// TestUnreadableRecordKeepsPins: a member record podfence cannot decode
// (one that another version wrote, say) belongs to a pod it cannot see. The
// DEL of another replica must succeed and leave the pins to it; once the
// runtime no longer lists that container, GC drops the record and then the
// pins.
func TestUnreadableRecordKeepsPins(t *testing.T) {
	c := lcCluster(t, attachModes(t)[0])
	a := c.addPod(webReplicas[0], "default")
	b := c.addPod(webReplicas[1], "default")
	record := pinpath.Root(c.pinRoot).Record(podid.ID(webID), membership.Key(b.containerID, "eth0"))
	if err := os.Remove(record); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("podfence-member v99 from a version to come", record); err != nil {
		t.Fatal(err)
	}

	c.delPod(a) // fails the test on an error
	if _, _, err := bpf.PinnedProgramIDs(c.identifierDir(string(webID))); err != nil {
		t.Fatalf("the last readable member's DEL removed pins an unreadable member may use: %v", err)
	}

	conf := lcConf(c, "1.1.0")
	conf["cni.dev/valid-attachments"] = []types.GCAttachment{{ContainerID: b.containerID, IfName: "eth0"}}
	if _, err := lcExec(t, c, lcCall{cmd: "GC", conf: conf}); err != nil {
		t.Fatalf("GC keeping the unreadable member: %v", err)
	}
	if _, err := os.Readlink(record); err != nil {
		t.Fatalf("GC removed a member the runtime still lists: %v", err)
	}

	conf["cni.dev/valid-attachments"] = []types.GCAttachment{}
	if _, err := lcExec(t, c, lcCall{cmd: "GC", conf: conf}); err != nil {
		t.Fatalf("GC dropping the unreadable member: %v", err)
	}
	if exists(c.identifierDir(webID)) {
		t.Errorf("identifier left after GC dropped its only member: %s", listDir(c.identifierDir(webID)))
	}
}

// TestIncompatibleIdentifierPins: pins of an identifier that this build
// cannot use (another build's, say) are replaced when no member uses them,
// and refused with a clear error while one does.
func TestIncompatibleIdentifierPins(t *testing.T) {
	c := lcCluster(t, attachModes(t)[0])
	pinWrongCounters := func() {
		t.Helper()
		dir := c.identifierDir(webID)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		_ = os.Remove(filepath.Join(dir, pinpath.MapCounters))
		// Values of another size: no layout converts them (one of
		// another capacity would be taken over, see TestUpgrade).
		m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.PerCPUArray, KeySize: 4, ValueSize: 16, MaxEntries: 3})
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		if err := m.Pin(filepath.Join(dir, pinpath.MapCounters)); err != nil {
			t.Fatal(err)
		}
	}

	// Unused: replaced, and the ADD succeeds with a datapath of this build.
	pinWrongCounters()
	a := c.addPod(webReplicas[0], "default")
	lcRequireEnforced(t, c, a)
	if log, _ := os.ReadFile(c.logFile); !strings.Contains(string(log), `"replaced_unused_pins"`) {
		t.Errorf("the log does not say that the pins were replaced:\n%s", log)
	}

	// In use by a: refused, and a's datapath is left as it was.
	in, eg, err := bpf.PinnedProgramIDs(c.identifierDir(string(webID)))
	if err != nil {
		t.Fatal(err)
	}
	pinWrongCounters()
	_, err = c.tryAddPod(webReplicas[1], "default")
	lcWantCNIError(t, err, 102, pinpath.MapCounters, "incompatible pin", "in use by 1 members")
	if in2, eg2, err := bpf.PinnedProgramIDs(c.identifierDir(string(webID))); err != nil || in2 != in || eg2 != eg {
		t.Errorf("programs of the live identifier changed: %d/%d -> %d/%d (%v)", in, eg, in2, eg2, err)
	}
	lcRequireEnforced(t, c, a)
}
