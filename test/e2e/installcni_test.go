package e2e

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"testing"
)

// installCNI runs podfence-sweeper install-cni or uninstall-cni on a
// node's directories (no namespace needed: it only edits files).
func installCNI(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(filepath.Join(binDir, "podfence-sweeper"), args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if err != nil {
		return out.String(), errors.Join(err, errors.New(errb.String()))
	}
	return out.String(), nil
}

// TestInstallCNI: the init container's job on the VPC CNI's conflist shape.
// Installing chains podfence last and installs the binary; a second run
// changes nothing; uninstalling gives back the primary CNI's list and
// removes the binary; a malformed conflist is refused and left untouched.
func TestInstallCNI(t *testing.T) {
	vpc, err := os.ReadFile("../../pkg/cniconf/testdata/10-aws.conflist")
	if err != nil {
		t.Fatal(err)
	}
	confDir, cniBin := t.TempDir(), t.TempDir()
	conflist := filepath.Join(confDir, "10-aws.conflist")
	if err := os.WriteFile(conflist, vpc, 0o644); err != nil {
		t.Fatal(err)
	}
	args := []string{"--cni-conf-dir", confDir, "--cni-bin-dir", cniBin, "--plugin", filepath.Join(binDir, "podfence")}

	if out, err := installCNI(t, append([]string{"install-cni"}, args...)...); err != nil {
		t.Fatalf("install-cni: %v\n%s", err, out)
	}
	installed, err := os.ReadFile(conflist)
	if err != nil {
		t.Fatal(err)
	}
	var list struct {
		Plugins []map[string]any `json:"plugins"`
	}
	if err := json.Unmarshal(installed, &list); err != nil {
		t.Fatal(err)
	}
	var types []any
	for _, p := range list.Plugins {
		types = append(types, p["type"])
	}
	if want := []any{"aws-cni", "egress-cni", "portmap", "podfence"}; !reflect.DeepEqual(types, want) {
		t.Fatalf("plugins %v, want %v", types, want)
	}
	fi, err := os.Stat(filepath.Join(cniBin, "podfence"))
	if err != nil || fi.Mode().Perm()&0o111 == 0 {
		t.Fatalf("podfence not installed executable: %v %v", fi, err)
	}
	// The installed plugin answers as podfence does.
	if out, err := exec.Command(filepath.Join(cniBin, "podfence")).CombinedOutput(); !bytes.Contains(out, []byte("podfence")) {
		t.Errorf("the installed binary is not podfence: %v: %s", err, out)
	}

	if out, err := installCNI(t, append([]string{"install-cni"}, args...)...); err != nil {
		t.Fatalf("second install-cni: %v\n%s", err, out)
	}
	if again, _ := os.ReadFile(conflist); !bytes.Equal(again, installed) {
		t.Errorf("a second install changed the conflist:\n%s", again)
	}

	if out, err := installCNI(t, "uninstall-cni", "--cni-conf-dir", confDir, "--cni-bin-dir", cniBin); err != nil {
		t.Fatalf("uninstall-cni: %v\n%s", err, out)
	}
	var before, after any
	restored, _ := os.ReadFile(conflist)
	json.Unmarshal(vpc, &before)
	json.Unmarshal(restored, &after)
	if !reflect.DeepEqual(before, after) {
		t.Errorf("uninstall did not give back the primary CNI's list:\n%s", restored)
	}
	if _, err := os.Stat(filepath.Join(cniBin, "podfence")); !os.IsNotExist(err) {
		t.Errorf("the podfence binary is still installed: %v", err)
	}
	if out, err := installCNI(t, "uninstall-cni", "--cni-conf-dir", confDir, "--cni-bin-dir", cniBin); err != nil {
		t.Errorf("a second uninstall-cni: %v\n%s", err, out)
	}

	malformed := []byte(`{"cniVersion": "0.4.0", "plugins": [{"type": "aws-cni"},`)
	if err := os.WriteFile(conflist, malformed, 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = installCNI(t, append([]string{"install-cni"}, args...)...)
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 || !bytes.Contains([]byte(err.Error()), []byte("malformed CNI conflist")) {
		t.Errorf("install-cni on a malformed conflist: %v, want exit 1 naming it malformed", err)
	}
	if got, _ := os.ReadFile(conflist); !bytes.Equal(got, malformed) {
		t.Errorf("a malformed conflist was changed:\n%s", got)
	}
	if _, err := os.Stat(filepath.Join(cniBin, "podfence")); !os.IsNotExist(err) {
		t.Errorf("the binary was installed beside a malformed conflist: %v", err)
	}
}
