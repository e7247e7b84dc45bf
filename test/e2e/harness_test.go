package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"

	"github.com/containernetworking/cni/libcni"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/podfence/podfence/pkg/attach"
	"github.com/podfence/podfence/test/kernel"
	"github.com/podfence/podfence/test/netnsutil"
)

// binDir holds the binaries a runtime would find in /opt/cni/bin: podfence,
// and ptp and host-local from containernetworking/plugins standing in for
// the AWS VPC CNI. TestMain builds them.
var binDir string

func TestMain(m *testing.M) {
	if os.Geteuid() != 0 {
		// Every test here needs root; they skip themselves.
		os.Exit(m.Run())
	}
	dir, err := os.MkdirTemp("", "podfence-e2e-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binDir = dir
	// In parallel: each is mostly a link, and two run on two cores in the
	// time of one after the other.
	pkgs := []string{
		"github.com/podfence/podfence/plugins/podfence",
		"github.com/podfence/podfence/sweeper",
		"github.com/containernetworking/plugins/plugins/main/ptp",
		"github.com/containernetworking/plugins/plugins/ipam/host-local",
	}
	var wg sync.WaitGroup
	errs := make([]error, len(pkgs))
	for i, pkg := range pkgs {
		name := filepath.Base(pkg)
		if name == "sweeper" {
			name = "podfence-sweeper"
		}
		build := exec.Command("go", "build", "-o", filepath.Join(dir, name), pkg)
		build.Env = append(os.Environ(), "CGO_ENABLED=0") // static, as make build makes it
		if raceDetector && (strings.HasSuffix(pkg, "/podfence") || strings.HasSuffix(pkg, "/sweeper")) {
			build.Args = append(build.Args[:2], append([]string{"-race"}, build.Args[2:]...)...)
			build.Env = append(os.Environ(), "CGO_ENABLED=1") // -race needs cgo
		}
		wg.Go(func() {
			if out, err := build.CombinedOutput(); err != nil {
				errs[i] = fmt.Errorf("build %s: %v\n%s", pkg, err, out)
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// cluster is one node: a network namespace playing the host, a pin root of
// its own, a policy directory, and a conflist chaining ptp and podfence.
type cluster struct {
	t          testing.TB
	node       ns.NetNS
	pinRoot    string
	policyDir  string
	logFile    string
	attachMode string
	cni        *libcni.CNIConfig
	sweeperBin string // podfence-sweeper of the build the node runs
	list       *libcni.NetworkConfigList
	confBytes  []byte
}

var podSeq atomic.Int64

func newCluster(t testing.TB, attachMode string) *cluster {
	t.Helper()
	return buildCluster(t, attachMode, false)
}

// newDualStackCluster is newCluster whose pods also get an IPv6 address,
// from podRange6.
func newDualStackCluster(t testing.TB, attachMode string) *cluster {
	t.Helper()
	return buildCluster(t, attachMode, true)
}

var podRange6 = netip.MustParsePrefix("fd88::/64")

func buildCluster(t testing.TB, attachMode string, dualStack bool) *cluster {
	t.Helper()
	kernel.RequireRoot(t)
	tmp := t.TempDir()
	c := &cluster{
		t:          t,
		node:       netnsutil.New(t),
		pinRoot:    kernel.PinRoot(t),
		policyDir:  filepath.Join(tmp, "policies"),
		logFile:    filepath.Join(tmp, "podfence.log"),
		attachMode: attachMode,
		cni:        libcni.NewCNIConfig([]string{binDir}, nil),
		sweeperBin: filepath.Join(binDir, "podfence-sweeper"),
	}
	if err := os.MkdirAll(c.policyDir, 0o755); err != nil {
		t.Fatal(err)
	}
	ranges := [][]map[string]string{{{"subnet": "10.88.0.0/16"}}}
	if dualStack {
		ranges = append(ranges, []map[string]string{{"subnet": podRange6.String()}})
		// ptp gives every host veth the range's gateway address and waits
		// for duplicate address detection in the pod only: on the node
		// side the gateway stays tentative, unanswered, for a second or
		// more. This namespace's interfaces skip it.
		netnsutil.Do(t, c.node, func() error {
			return os.WriteFile("/proc/sys/net/ipv6/conf/default/accept_dad", []byte("0"), 0o644)
		})
	}
	conf := map[string]any{
		"cniVersion": "1.0.0",
		"name":       "podfence-e2e",
		"plugins": []any{
			map[string]any{
				"type":   "ptp",
				"ipMasq": false,
				"ipam": map[string]any{
					"type":    "host-local",
					"ranges":  ranges,
					"dataDir": filepath.Join(tmp, "ipam"),
				},
			},
			map[string]any{
				"type":       "podfence",
				"pinRoot":    c.pinRoot,
				"policyDir":  c.policyDir,
				"attachMode": attachMode,
				"logFile":    c.logFile,
			},
		},
	}
	var err error
	c.confBytes, err = json.Marshal(conf)
	if err != nil {
		t.Fatal(err)
	}
	c.list, err = libcni.ConfListFromBytes(c.confBytes)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			if log, err := os.ReadFile(c.logFile); err == nil {
				t.Logf("podfence log:\n%s", log)
			}
		}
	})
	return c
}

// pod is a pod sandbox: its network namespace and what the chain gave it.
type pod struct {
	name, namespace string
	containerID     string
	netns           ns.NetNS
	ip              netip.Addr
	ip6             netip.Addr // in a dual-stack cluster
	hostVeth        string
	deleted         bool
}

func (c *cluster) runtimeConf(p *pod) *libcni.RuntimeConf {
	return &libcni.RuntimeConf{
		ContainerID: p.containerID,
		NetNS:       p.netns.Path(),
		IfName:      "eth0",
		Args: [][2]string{
			{"IgnoreUnknown", "1"},
			{"K8S_POD_NAMESPACE", p.namespace},
			{"K8S_POD_NAME", p.name},
		},
	}
}

// useBuild makes the node run the podfence and podfence-sweeper binaries
// in dir from now on (ptp and host-local stay binDir's), as a rollout
// installs another build.
func (c *cluster) useBuild(dir string) {
	c.cni = libcni.NewCNIConfig([]string{dir, binDir}, nil)
	c.sweeperBin = filepath.Join(dir, "podfence-sweeper")
}

// inNode runs fn on a thread in the node namespace: plugins exec'd from it
// run there, as they run in the host namespace on a real node.
func (c *cluster) inNode(fn func() error) error {
	return c.node.Do(func(ns.NetNS) error { return fn() })
}

// addPod creates a pod namespace and runs the conflist's ADD for it, the
// way a container runtime does. The pod is deleted when the test ends.
func (c *cluster) addPod(name, namespace string) *pod {
	c.t.Helper()
	p, err := c.tryAddPod(name, namespace)
	if err != nil {
		c.t.Fatalf("ADD %s/%s: %v", namespace, name, err)
	}
	return p
}

func (c *cluster) tryAddPod(name, namespace string) (*pod, error) {
	c.t.Helper()
	p := &pod{
		name:        name,
		namespace:   namespace,
		containerID: fmt.Sprintf("ctr%06d", podSeq.Add(1)),
		netns:       netnsutil.New(c.t),
	}
	c.t.Cleanup(func() { c.delPodQuiet(p) })
	var res *current.Result
	err := c.inNode(func() error {
		r, err := c.cni.AddNetworkList(context.Background(), c.list, c.runtimeConf(p))
		if err != nil {
			return err
		}
		res, err = current.NewResultFromResult(r)
		return err
	})
	if err != nil {
		return p, err
	}
	for _, ipc := range res.IPs {
		if ip4 := ipc.Address.IP.To4(); ip4 != nil {
			p.ip, _ = netip.AddrFromSlice(ip4)
		} else {
			p.ip6, _ = netip.AddrFromSlice(ipc.Address.IP)
		}
	}
	for _, iface := range res.Interfaces {
		if iface.Sandbox == "" {
			p.hostVeth = iface.Name
		}
	}
	return p, nil
}

func (c *cluster) delPod(p *pod) {
	c.t.Helper()
	if err := c.inNode(func() error {
		return c.cni.DelNetworkList(context.Background(), c.list, c.runtimeConf(p))
	}); err != nil {
		c.t.Fatalf("DEL %s/%s: %v", p.namespace, p.name, err)
	}
	p.deleted = true
}

func (c *cluster) delPodQuiet(p *pod) {
	if p.deleted {
		return
	}
	_ = c.inNode(func() error {
		return c.cni.DelNetworkList(context.Background(), c.list, c.runtimeConf(p))
	})
	p.deleted = true
}

// writePolicy puts a PolicyEndpoint document into the policy directory;
// ADDs after it program it.
func (c *cluster) writePolicy(name, doc string) {
	c.t.Helper()
	if err := os.WriteFile(filepath.Join(c.policyDir, name+".yaml"), []byte(doc), 0o644); err != nil {
		c.t.Fatal(err)
	}
}

// connects dials from one pod to another's port.
func (c *cluster) connects(from, to *pod, port uint16) bool {
	c.t.Helper()
	return netnsutil.Connects(c.t, from.netns, netip.AddrPortFrom(to.ip, port), 300*time.Millisecond, 3)
}

// identifierDir is where the identifier's pins are.
func (c *cluster) identifierDir(id string) string {
	return pinpath.Root(c.pinRoot).Identifier(podid.ID(id))
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

// attachModes are the modes this kernel can run: tc always, tcx from 6.6.
func attachModes(t testing.TB) []string {
	modes := []string{"tc"}
	if attach.TCXSupported() == nil {
		modes = append([]string{"tcx"}, modes...)
	} else {
		t.Logf("tcx not tested: %v", attach.TCXSupported())
	}
	return modes
}

func netnsutilListen(t *testing.T, p *pod, port uint16) {
	t.Helper()
	netnsutil.Listen(t, p.netns, port)
}

// globalDir is where a pin root keeps the node-wide maps, for tests that
// read them directly.
func globalDir(pinRoot string) string { return pinpath.Root(pinRoot).Global() }
