package kubeapi

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// controllerModule is the upstream network-policy controller, whose
// CustomResourceDefinitions are the ones a cluster runs: it installs them
// itself, and podfence ships none that could replace them. The version is
// podfence's go.mod's (the controller's API types test the parser).
const controllerModule = "github.com/aws/amazon-network-policy-controller-k8s"

// ControllerCRD is the controller's CRD of the plural resource name
// (policyendpoints, clusterpolicyendpoints, ...), read from its module as
// go.mod pins it.
func ControllerCRD(tb testing.TB, resource string) []byte {
	tb.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", controllerModule).Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		tb.Fatalf("locate %s: %v: %s", controllerModule, err, stderr)
	}
	dir := strings.TrimSpace(string(out))
	if dir == "" {
		// Listed but not downloaded yet.
		if b, err := exec.Command("go", "mod", "download", controllerModule).CombinedOutput(); err != nil {
			tb.Fatalf("download %s: %v: %s", controllerModule, err, b)
		}
		return ControllerCRD(tb, resource)
	}
	crd, err := os.ReadFile(filepath.Join(dir, "config", "crd", "bases", "networking.k8s.aws_"+resource+".yaml"))
	if err != nil {
		tb.Fatal(err)
	}
	return crd
}
