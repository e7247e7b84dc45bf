// Package realnode tests podfence on a real Kubernetes node (package
// test/node): a kubelet creating pods through containerd, NetworkPolicies
// turned into PolicyEndpoints by the upstream controller, podfence
// installed from its image and manifest, Services through kube-proxy.
// One node serves every test of a run; the host is checked to be left as
// it was found when it goes. PODFENCE_NODE_STATE=DIR runs them on a node
// that runs already (make cluster's), which they leave running.
package realnode

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/podfence/podfence/test/kubeapi"
	"github.com/podfence/podfence/test/node"
)

// theNode is the run's node; nil when the tests skip (no root, no tools).
var theNode *node.Node

// hostBefore is the host as it was before the node started.
var hostBefore node.Host

// skipWhy says why there is no node.
var skipWhy string

func TestMain(m *testing.M) {
	node.MaybeSupervise()
	os.Exit(run(m))
}

func run(m *testing.M) int {
	tools := os.Getenv(kubeapi.ToolsEnv)
	switch {
	case os.Geteuid() != 0:
		skipWhy = "needs root"
	case tools == "" && os.Getenv(kubeapi.RequireEnv) == "1":
		fmt.Fprintf(os.Stderr, "%s is not set: run hack/k8s-tools.sh (make test does)\n", kubeapi.ToolsEnv)
		return 1
	case tools == "":
		skipWhy = kubeapi.ToolsEnv + " is not set: no node to test on (make test builds one)"
	}
	if skipWhy != "" {
		return m.Run()
	}
	// A node that runs already (make cluster): used as it is, and left.
	if state := os.Getenv("PODFENCE_NODE_STATE"); state != "" {
		n, err := node.Attach(state)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		theNode = n
		return m.Run()
	}
	before, err := node.SnapshotHost()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	hostBefore = before
	n, err := startNode(tools)
	if err != nil {
		fmt.Fprintln(os.Stderr, "node:", err)
		return 1
	}
	theNode = n
	code := m.Run()
	if err := n.Down(); err != nil {
		fmt.Fprintln(os.Stderr, "node down:", err)
		code = 1
	}
	after, err := node.SnapshotHost()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if diff := before.Diff(after); diff != "" {
		fmt.Fprintf(os.Stderr, "FAIL: the node changed the host:\n%s", diff)
		code = 1
	}
	if code == 0 {
		os.RemoveAll(n.State)
	}
	return code
}

// startNode builds what the node needs beyond the tools (the CNI plugins,
// podfence's image) and starts it with podfence installed.
func startNode(tools string) (*node.Node, error) {
	root, err := filepath.Abs("../..")
	if err != nil {
		return nil, err
	}
	cni, err := exec.Command(filepath.Join(root, "hack", "cni-plugins.sh")).Output()
	if err != nil {
		return nil, fmt.Errorf("hack/cni-plugins.sh: %w", err)
	}
	state, err := os.MkdirTemp("", "podfence-node-")
	if err != nil {
		return nil, err
	}
	image, err := podfenceImage(root, state)
	if err != nil {
		return nil, err
	}
	manifest, err := os.ReadFile(filepath.Join(root, "conf", "podfence-sweeper.yaml"))
	if err != nil {
		return nil, err
	}
	n, err := node.Up(node.Options{State: filepath.Join(state, "node"), Tools: tools,
		CNIBin: strings.TrimSpace(string(cni)), Images: []string{image}, ProxyMode: os.Getenv("PODFENCE_PROXY_MODE")})
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(os.Stderr, "node up (%s); installing podfence: %s\n", n.State, node.SweeperManifestChange)
	if err := n.InstallPodfence(manifest); err != nil {
		return nil, errors.Join(err, n.Down())
	}
	return n, nil
}

// podfenceImage builds podfence's image as make image does.
func podfenceImage(root, dir string) (string, error) {
	bins := filepath.Join(dir, "bin")
	for pkg, name := range map[string]string{"./plugins/podfence": "podfence", "./sweeper": "podfence-sweeper"} {
		cmd := exec.Command("go", "build", "-o", filepath.Join(bins, name), pkg)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			return "", fmt.Errorf("build %s: %w: %s", pkg, err, out)
		}
	}
	out := filepath.Join(dir, "podfence-image.tar")
	cmd := exec.Command("go", "run", "./hack/image", "-o", out, filepath.Join(bins, "podfence"), filepath.Join(bins, "podfence-sweeper"))
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("hack/image: %w: %s", err, b)
	}
	return out, nil
}

// needNode skips a test without a node.
func needNode(tb testing.TB) *node.Node {
	tb.Helper()
	if theNode == nil {
		tb.Skip(skipWhy)
	}
	return theNode
}
