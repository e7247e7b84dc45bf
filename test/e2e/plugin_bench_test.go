package e2e

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/test/kernel"
	"github.com/podfence/podfence/test/netnsutil"
)

var benchCalls = flag.Int("plugin.calls", 200, "measured calls per case in BenchmarkPlugin")

// benchNode is a node namespace with veths to pod namespaces, enough for
// BenchmarkPlugin to invoke the podfence binary the way libcni does (a
// prevResult on stdin, CNI_* in the environment) without a primary plugin.
type benchNode struct {
	node    ns.NetNS
	pods    []ns.NetNS
	veths   []string
	pinRoot string
	policy  string
}

func newBenchNode(b *testing.B, n int) *benchNode {
	b.Helper()
	bn := &benchNode{node: netnsutil.New(b), pinRoot: kernel.PinRoot(b), policy: b.TempDir()}
	doc := `apiVersion: networking.k8s.aws/v1alpha1
kind: PolicyEndpoint
metadata: {name: web, namespace: default}
spec:
  podIsolation: [Ingress, Egress]
  podSelectorEndpoints: [{name: web-7f65cc6544-9j58r, namespace: default}]
  ingress:
  - {cidr: 10.0.0.0/8, except: [10.66.0.0/16], ports: [{protocol: TCP, port: 8080}]}
  - {cidr: 192.168.0.0/16, ports: [{protocol: TCP, port: 9090, endPort: 9099}]}
  egress:
  - {cidr: 10.96.0.10/32, ports: [{protocol: UDP, port: 53}, {protocol: TCP, port: 53}]}
`
	if err := os.WriteFile(filepath.Join(bn.policy, "web.yaml"), []byte(doc), 0o644); err != nil {
		b.Fatal(err)
	}
	for i := 0; i < n; i++ {
		pod := netnsutil.New(b)
		veth := fmt.Sprintf("bench%d", i)
		netnsutil.Do(b, bn.node, func() error {
			h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
			if err != nil {
				return err
			}
			defer h.Close()
			if err := h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: veth}, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(pod.Fd()))}); err != nil {
				return err
			}
			l, err := h.LinkByName(veth)
			if err != nil {
				return err
			}
			return h.LinkSetUp(l)
		})
		bn.pods = append(bn.pods, pod)
		bn.veths = append(bn.veths, veth)
	}
	return bn
}

// invoke runs one podfence command for the container on veth i and returns
// how long the binary took.
func (bn *benchNode) invoke(cmd, container, podName string, i int, withPrev bool) (time.Duration, error) {
	// PODFENCE_BENCH_LOG names a log file for the plugin's per-call lines,
	// whose phase timings show where a call spends its time.
	conf := map[string]any{
		"cniVersion": "1.0.0", "name": "bench", "type": "podfence",
		"pinRoot": bn.pinRoot, "policyDir": bn.policy, "logFile": os.Getenv("PODFENCE_BENCH_LOG"),
	}
	netnsPath := bn.pods[i].Path()
	if withPrev {
		conf["prevResult"] = map[string]any{
			"cniVersion": "1.0.0",
			"interfaces": []any{
				map[string]any{"name": bn.veths[i]},
				map[string]any{"name": "eth0", "sandbox": netnsPath},
			},
			"ips": []any{map[string]any{"address": fmt.Sprintf("10.55.%d.%d/32", i/250, i%250+2), "interface": 1}},
		}
	}
	stdin, err := json.Marshal(conf)
	if err != nil {
		return 0, err
	}
	c := exec.Command(filepath.Join(binDir, "podfence"))
	c.Env = []string{
		"CNI_COMMAND=" + cmd, "CNI_CONTAINERID=" + container, "CNI_NETNS=" + netnsPath,
		"CNI_IFNAME=eth0", "CNI_PATH=" + binDir,
		"CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=" + podName,
	}
	c.Stdin = bytes.NewReader(stdin)
	var out bytes.Buffer
	c.Stdout = &out
	var took time.Duration
	err = bn.node.Do(func(ns.NetNS) error {
		start := time.Now()
		err := c.Run()
		took = time.Since(start)
		return err
	})
	if err != nil {
		return took, fmt.Errorf("%s %s: %v: %s", cmd, container, err, out.String())
	}
	return took, nil
}

func percentiles(b *testing.B, name string, d []time.Duration) {
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	ms := func(x time.Duration) float64 { return float64(x.Microseconds()) / 1000 }
	b.ReportMetric(ms(d[len(d)/2]), name+"-p50-ms")
	b.ReportMetric(ms(d[len(d)*99/100]), name+"-p99-ms")
}

// BenchmarkPlugin measures the podfence binary's own ADD and DEL, invoked
// with a prevResult as libcni invokes it (no primary plugin runs): for the
// first replica of an identifier (programs loaded, verified and pinned), for
// later replicas (pins reused), and 64 concurrent ADDs of one identifier.
// Each case makes -plugin.calls measured calls whatever b.N is; run it with
// -benchtime=1x (hack/bench.sh does).
func BenchmarkPlugin(b *testing.B) {
	kernel.RequireRoot(b)
	bn := newBenchNode(b, 64)

	b.Run("first-replica", func(b *testing.B) {
		for n := 0; n < b.N; n++ {
			var add, del []time.Duration
			for i := 0; i < *benchCalls; i++ {
				pod := fmt.Sprintf("solo-%d", i) // a bare pod: an identifier of its own
				v := i % len(bn.veths)
				d, err := bn.invoke("ADD", pod, pod, v, true)
				if err != nil {
					b.Fatal(err)
				}
				add = append(add, d)
				if d, err = bn.invoke("DEL", pod, pod, v, true); err != nil {
					b.Fatal(err)
				}
				del = append(del, d) // the last member: removes the pins too
			}
			percentiles(b, "add", add)
			percentiles(b, "del-last", del)
		}
	})

	b.Run("later-replica", func(b *testing.B) {
		if _, err := bn.invoke("ADD", "web-keep", "web-7f65cc6544-9j58r", 0, true); err != nil {
			b.Fatal(err)
		}
		defer bn.invoke("DEL", "web-keep", "web-7f65cc6544-9j58r", 0, false)
		for n := 0; n < b.N; n++ {
			var add, del []time.Duration
			for i := 0; i < *benchCalls; i++ {
				ctr := fmt.Sprintf("web-%d", i)
				v := 1 + i%(len(bn.veths)-1)
				d, err := bn.invoke("ADD", ctr, "web-7f65cc6544-x2k4p", v, true)
				if err != nil {
					b.Fatal(err)
				}
				add = append(add, d)
				if d, err = bn.invoke("DEL", ctr, "web-7f65cc6544-x2k4p", v, true); err != nil {
					b.Fatal(err)
				}
				del = append(del, d)
			}
			percentiles(b, "add", add)
			percentiles(b, "del", del)
		}
	})

	b.Run("64-concurrent-adds", func(b *testing.B) {
		for n := 0; n < b.N; n++ {
			var wg sync.WaitGroup
			errs := make([]error, len(bn.veths))
			start := time.Now()
			for i := range bn.veths {
				wg.Add(1)
				go func() {
					defer wg.Done()
					_, errs[i] = bn.invoke("ADD", fmt.Sprintf("burst-%d", i), "web-7f65cc6544-bcdfg", i, true)
				}()
			}
			wg.Wait()
			took := time.Since(start)
			failed := 0
			for _, err := range errs {
				if err != nil {
					failed++
					b.Error(err)
				}
			}
			b.ReportMetric(float64(took.Milliseconds()), "all-64-ms")
			b.ReportMetric(float64(failed), "failed")
			for i := range bn.veths {
				if _, err := bn.invoke("DEL", fmt.Sprintf("burst-%d", i), "web-7f65cc6544-bcdfg", i, false); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
}
