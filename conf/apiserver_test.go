package conf

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/podfence/podfence/test/kubeapi"
	"github.com/podfence/podfence/test/netnsutil"
)

// TestManifestsOnAPIServer applies every manifest in conf/ to a real
// kube-apiserver with a server-side dry run and strict field validation:
// what the API server would refuse at `kubectl apply` fails here. The
// controller's PolicyEndpoint CRD is installed first, so the example
// policies are checked against the schema a cluster runs.
func TestManifestsOnAPIServer(t *testing.T) {
	api := kubeapi.Start(t, kubeapi.Options{Netns: netnsutil.New(t)})
	ctx := context.Background()
	dryRun := func(manifest []byte, namespace string) error {
		_, err := api.Apply(ctx, manifest, kubeapi.ApplyOptions{Namespace: namespace, DryRun: true})
		return err
	}

	api.InstallCRDs(ctx, kubeapi.ControllerCRD(t, "policyendpoints"))

	sweeper := readFile(t, sweeperManifest)
	if err := dryRun(sweeper, "kube-system"); err != nil {
		t.Errorf("%s: %v", sweeperManifest, err)
	}
	examples, err := filepath.Glob("policies/*.yaml")
	if err != nil || len(examples) == 0 {
		t.Fatalf("no example policies in conf/policies (%v)", err)
	}
	for _, f := range examples {
		if err := dryRun(readFile(t, f), "default"); err != nil {
			t.Errorf("%s: %v", f, err)
		}
	}

	// The same checks refuse what a typo makes of the files.
	broken := strings.Replace(string(sweeper), "hostNetwork: true", "hostNetwrok: true", 1)
	if err := dryRun([]byte(broken), "kube-system"); err == nil || !strings.Contains(err.Error(), "hostNetwrok") {
		t.Errorf("a DaemonSet with hostNetwrok: dry run error = %v, want one naming the field", err)
	}
	example := string(readFile(t, examples[0]))
	// (The controller's schema leaves protocol free: "ICMP" is admitted,
	// and podfence's parser refuses such a document, which then enforces
	// its fallback; pkg/policy tests that.)
	for _, typo := range []struct{ from, to string }{
		{"cidr:", "cdir:"},
	} {
		if !strings.Contains(example, typo.from) {
			t.Fatalf("%s holds no %q to break", examples[0], typo.from)
		}
		doc := strings.Replace(example, typo.from, typo.to, 1)
		if err := dryRun([]byte(doc), "default"); err == nil {
			t.Errorf("%s with %q for %q: the CRD schema accepted it", examples[0], typo.to, typo.from)
		}
	}
}

func readFile(t *testing.T, name string) []byte {
	t.Helper()
	data, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return data
}
