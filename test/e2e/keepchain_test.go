package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// rewriteAtomic replaces path as aws-node does when it writes its conflist
// from its template: a temporary file renamed over it.
func rewriteAtomic(t *testing.T, path string, data []byte) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// lastPlugin is the last entry of the conflist at path (nil if it has none
// or does not parse).
func lastPlugin(path string) map[string]any {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	var list struct {
		Plugins []map[string]any `json:"plugins"`
	}
	if json.Unmarshal(b, &list) != nil || len(list.Plugins) == 0 {
		return nil
	}
	return list.Plugins[len(list.Plugins)-1]
}

// eventually polls ok for up to 10 s.
func eventually(t *testing.T, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !ok(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("after 10s: %s", what)
		}
	}
}

// TestSweeperKeepsChain: `run --keep-chained` puts podfence back when the
// primary CNI rewrites its conflist from its template (aws-node does at
// every start), with the entry the node had (here strict, set at install),
// and puts the plugin binary back when the directory is cleaned. A
// conflist it cannot parse is left as it is and reported.
func TestSweeperKeepsChain(t *testing.T) {
	template, err := os.ReadFile("../../pkg/cniconf/testdata/10-aws.conflist")
	if err != nil {
		t.Fatal(err)
	}
	c := lcCluster(t, attachModes(t)[0])
	confDir, cniBin := t.TempDir(), t.TempDir()
	conflist := filepath.Join(confDir, "10-aws.conflist")
	if err := os.WriteFile(conflist, template, 0o644); err != nil {
		t.Fatal(err)
	}
	plugin := filepath.Join(binDir, "podfence")
	dirs := []string{"--cni-conf-dir", confDir, "--cni-bin-dir", cniBin, "--plugin", plugin}
	if out, err := installCNI(t, append([]string{"install-cni", "--enforcing-mode", "strict", "--pin-root", c.pinRoot, "--policy-dir", c.policyDir}, dirs...)...); err != nil {
		t.Fatalf("install-cni: %v\n%s", err, out)
	}
	installed, err := os.ReadFile(conflist)
	if err != nil {
		t.Fatal(err)
	}
	// The sweeper's own flags would write standard mode: a repair must
	// write back the node's entry instead.
	_, logs := c.runSweeper(t, append([]string{"--keep-chained"}, dirs...)...)
	c.waitHealthy(t)

	rewriteAtomic(t, conflist, template)
	eventually(t, "podfence not chained last again", func() bool {
		b, _ := os.ReadFile(conflist)
		return bytes.Equal(b, installed)
	})
	logs.waitFor(t, "chained podfence last again", time.Second)
	if pf := lastPlugin(conflist); pf["enforcingMode"] != "strict" {
		t.Errorf("podfence's entry after the repair: %v, want the node's (strict)", pf)
	}

	if err := os.Remove(filepath.Join(cniBin, "podfence")); err != nil {
		t.Fatal(err)
	}
	want, err := os.ReadFile(plugin)
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the plugin binary not put back", func() bool {
		b, _ := os.ReadFile(filepath.Join(cniBin, "podfence"))
		return bytes.Equal(b, want)
	})
	if fi, err := os.Stat(filepath.Join(cniBin, "podfence")); err != nil || fi.Mode().Perm()&0o111 == 0 {
		t.Errorf("the binary put back is not executable: %v %v", fi, err)
	}

	// The counters go up after the writes the test saw.
	counted := map[string]string{
		`podfence_cni_chain_repairs_total{part="conflist"}`: "1",
		`podfence_cni_chain_repairs_total{part="binary"}`:   "1",
		`podfence_cni_chain_intact`:                         "1",
	}
	eventually(t, fmt.Sprintf("metrics %v", counted), func() bool {
		page, err := c.get("/metrics")
		if err != nil {
			return false
		}
		for series, v := range counted {
			if !strings.Contains(page, "\n"+series+" "+v+"\n") {
				return false
			}
		}
		return true
	})

	// A list podfence cannot parse is never rewritten: reported, and the
	// chain counted as broken.
	malformed := []byte(`{"cniVersion": "0.4.0", "plugins": [{"type": "aws-cni"},`)
	rewriteAtomic(t, conflist, malformed)
	logs.waitFor(t, "cannot be put back", 10*time.Second)
	if got, _ := os.ReadFile(conflist); !bytes.Equal(got, malformed) {
		t.Errorf("a malformed conflist was changed:\n%s", got)
	}
	eventually(t, "podfence_cni_chain_intact not 0", func() bool {
		page, err := c.get("/metrics")
		return err == nil && strings.Contains(page, "\npodfence_cni_chain_intact 0\n")
	})

	// Fixed by its owner: chained again.
	rewriteAtomic(t, conflist, template)
	eventually(t, "podfence not chained after the list was fixed", func() bool {
		b, _ := os.ReadFile(conflist)
		return bytes.Equal(b, installed)
	})
}
