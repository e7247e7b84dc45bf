package e2e

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/membership"
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
	record := filepath.Join(c.identifierDir(webID), "members", membership.Key(b.containerID, "eth0"), "record")
	if err := os.Remove(record); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("podfence-member v99 from a version to come", record); err != nil {
		t.Fatal(err)
	}

	c.delPod(a) // fails the test on an error
	if _, _, err := bpf.PinnedProgramIDs(c.pinRoot, webID); err != nil {
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
