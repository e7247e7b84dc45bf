// Command demo shows podfence working on one machine: a "node" network
// namespace, pods in namespaces of their own, ptp + host-local standing in
// for the AWS VPC CNI, and podfence chained after them through libcni, the
// way a container runtime runs a conflist. Run it with `make demo` (root).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/pinroot"
	"github.com/podfence/podfence/pkg/podid"
)

func main() {
	binDir := flag.String("bin", "", "directory with the podfence, ptp and host-local binaries")
	flag.Parse()
	if err := run(*binDir); err != nil {
		fmt.Fprintln(os.Stderr, "demo failed:", err)
		os.Exit(1)
	}
}

type demo struct {
	node      ns.NetNS
	cni       *libcni.CNIConfig
	list      *libcni.NetworkConfigList
	pinRoot   string
	policies  string
	pods      []*pod
	surprises int // connections that did not do what the policy says
}

type pod struct {
	name   string
	netns  ns.NetNS
	ip     netip.Addr
	veth   string
	id     string
	ln     net.Listener
	active bool
}

func run(binDir string) (err error) {
	if os.Geteuid() != 0 {
		return errors.New("run as root: the demo creates network namespaces and loads eBPF programs")
	}
	tmp, err := os.MkdirTemp("", "podfence-demo-")
	if err != nil {
		return err
	}
	d := &demo{
		pinRoot:  fmt.Sprintf("/sys/fs/bpf/podfence-demo-%d", os.Getpid()),
		policies: filepath.Join(tmp, "policies"),
		cni:      libcni.NewCNIConfig([]string{binDir}, nil),
	}
	defer func() {
		step("Cleaning up: deleting the pods, the namespaces and the pin root.")
		if cerr := d.cleanup(); cerr != nil && err == nil {
			err = cerr
		}
		os.RemoveAll(tmp)
	}()
	if err := os.MkdirAll(d.policies, 0o755); err != nil {
		return err
	}
	if d.node, err = testutils.NewNS(); err != nil {
		return fmt.Errorf("create the node namespace: %w", err)
	}
	if err := d.setUpLoopback(d.node); err != nil {
		return err
	}
	conf, _ := json.Marshal(map[string]any{
		"cniVersion": "1.0.0",
		"name":       "demo",
		"plugins": []any{
			map[string]any{"type": "ptp", "ipMasq": false, "ipam": map[string]any{
				"type": "host-local", "ranges": [][]map[string]string{{{"subnet": "10.99.0.0/24"}}},
				"dataDir": filepath.Join(tmp, "ipam")}},
			map[string]any{"type": "podfence", "pinRoot": d.pinRoot, "policyDir": d.policies,
				"logFile": filepath.Join(tmp, "podfence.log")},
		},
	})
	if d.list, err = libcni.ConfListFromBytes(conf); err != nil {
		return err
	}

	step("A node (a network namespace) with the conflist ptp -> podfence; pins go to " + d.pinRoot + ".")
	frontend, err := d.addPod("frontend-5d8f7c9b6d-q7x2m")
	if err != nil {
		return err
	}
	intruder, err := d.addPod("intruder")
	if err != nil {
		return err
	}
	say("created pod %s (%s) and pod %s (%s); no policy selects them, so they are open (standard mode)",
		frontend.name, frontend.ip, intruder.name, intruder.ip)

	step("A policy: the web pods accept TCP 8080 from the frontend only.")
	policy := fmt.Sprintf(`apiVersion: networking.k8s.aws/v1alpha1
kind: PolicyEndpoint
metadata: {name: web-from-frontend, namespace: default}
spec:
  podIsolation: [Ingress]
  podSelectorEndpoints:
  - {name: web-7f65cc6544-9j58r, namespace: default}
  ingress:
  - cidr: %s/32
    ports: [{protocol: TCP, port: 8080}]
`, frontend.ip)
	if err := os.WriteFile(filepath.Join(d.policies, "web.yaml"), []byte(policy), 0o644); err != nil {
		return err
	}
	fmt.Print(indent(policy))

	step("Two replicas of the web Deployment start; podfence attaches before their first packet.")
	web1, err := d.addPod("web-7f65cc6544-9j58r")
	if err != nil {
		return err
	}
	web2, err := d.addPod("web-7f65cc6544-x2k4p")
	if err != nil {
		return err
	}
	for _, w := range []*pod{web1, web2} {
		if err := d.listen(w, 8080); err != nil {
			return err
		}
	}
	say("both replicas share the identifier %s, so they share one set of pinned programs and maps:", web1.id)
	if err := d.showIdentifier(web1.id); err != nil {
		return err
	}

	step("Traffic to the replicas.")
	for _, w := range []*pod{web1, web2} {
		d.tryConnect(frontend, w, 8080, true)
		d.tryConnect(intruder, w, 8080, false)
	}

	step("What the node shows: podfence-sweeper ls, then dump conntrack (the entries those connections left).")
	for _, args := range [][]string{{"ls"}, {"dump", "conntrack"}} {
		if err := d.sweeper(binDir, args...); err != nil {
			return err
		}
	}

	step("Why: podfence-sweeper why runs the web pod's own program on a packet, against the live maps, changing nothing.")
	for _, from := range []*pod{frontend, intruder} {
		if err := d.sweeper(binDir, "why", "--policy-dir", d.policies, "--pod", web1.name+".default",
			"--from", from.ip.String(), "8080/tcp"); err != nil {
			return err
		}
	}

	step("Scale down: the first replica is deleted. Its pins are shared, so they stay.")
	if err := d.delPod(web1); err != nil {
		return err
	}
	if err := d.showIdentifier(web2.id); err != nil {
		return err
	}
	d.tryConnect(frontend, web2, 8080, true)
	d.tryConnect(intruder, web2, 8080, false)

	step("Scale down to zero: the last replica's DEL removes the identifier's pins.")
	if err := d.delPod(web2); err != nil {
		return err
	}
	if _, err := os.Stat(pinpath.Root(d.pinRoot).Identifier(podid.ID(web2.id))); errors.Is(err, os.ErrNotExist) {
		say("%s is gone from bpffs: nothing of the web identifier is left", web2.id)
	} else {
		return fmt.Errorf("the identifier's pins are still there after the last replica left (%v)", err)
	}
	if d.surprises > 0 {
		return fmt.Errorf("%d connections did not do what the policy says", d.surprises)
	}
	step("Done: one connection allowed, one denied, two replicas sharing pins, scale-down to zero without leaks.")
	return nil
}

func (d *demo) addPod(name string) (*pod, error) {
	p := &pod{name: name}
	var err error
	if p.netns, err = testutils.NewNS(); err != nil {
		return nil, err
	}
	d.pods = append(d.pods, p)
	if err := d.setUpLoopback(p.netns); err != nil {
		return nil, err
	}
	var res *current.Result
	err = d.node.Do(func(ns.NetNS) error {
		r, err := d.cni.AddNetworkList(context.Background(), d.list, d.rt(p))
		if err != nil {
			return err
		}
		res, err = current.NewResultFromResult(r)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("ADD %s: %w", name, err)
	}
	p.active = true
	for _, ip := range res.IPs {
		p.ip, _ = netip.AddrFromSlice(ip.Address.IP.To4())
	}
	for _, iface := range res.Interfaces {
		if iface.Sandbox == "" {
			p.veth = iface.Name
		}
	}
	id, err := podid.FromPod(name, "default")
	if err != nil {
		return nil, err
	}
	p.id = string(id)
	say("ADD %s: ptp gave it %s on host veth %s; podfence attached the programs of %s", name, p.ip, p.veth, p.id)
	return p, nil
}

func (d *demo) rt(p *pod) *libcni.RuntimeConf {
	return &libcni.RuntimeConf{
		ContainerID: "demo-" + strings.ReplaceAll(p.name, ".", "-"),
		NetNS:       p.netns.Path(),
		IfName:      "eth0",
		Args:        [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", "default"}, {"K8S_POD_NAME", p.name}},
	}
}

func (d *demo) delPod(p *pod) error {
	err := d.node.Do(func(ns.NetNS) error {
		return d.cni.DelNetworkList(context.Background(), d.list, d.rt(p))
	})
	if err != nil {
		return fmt.Errorf("DEL %s: %w", p.name, err)
	}
	p.active = false
	if p.ln != nil {
		p.ln.Close()
	}
	say("DEL %s", p.name)
	return nil
}

func (d *demo) listen(p *pod, port int) error {
	return p.netns.Do(func(ns.NetNS) error {
		ln, err := net.Listen("tcp", fmt.Sprintf(":%d", port))
		if err != nil {
			return err
		}
		p.ln = ln
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				c.Close()
			}
		}()
		return nil
	})
}

// tryConnect dials and says what happened next to what the policy expects.
func (d *demo) tryConnect(from, to *pod, port int, want bool) {
	dst := netip.AddrPortFrom(to.ip, uint16(port))
	var got bool
	for i := 0; i < 3 && !got; i++ {
		_ = from.netns.Do(func(ns.NetNS) error {
			c, err := net.DialTimeout("tcp", dst.String(), 300*time.Millisecond)
			if err == nil {
				c.Close()
				got = true
			}
			return nil
		})
	}
	verdict := "ALLOWED"
	if !got {
		verdict = "DENIED (the SYN was dropped at the web pod's veth)"
	}
	mark := "as expected"
	if got != want {
		mark = "NOT AS EXPECTED"
		d.surprises++
	}
	say("%-28s -> %s %-22s %s, %s", from.name, to.name, dst, verdict, mark)
}

func (d *demo) showIdentifier(id string) error {
	lock, err := pinroot.At(d.pinRoot).Lock(podid.ID(id))
	if err != nil {
		return err
	}
	defer lock.Unlock()
	ms, err := lock.Members()
	if err != nil {
		return err
	}
	ingress, egress, err := lock.ProgramIDs()
	if err != nil {
		return err
	}
	entries, _ := os.ReadDir(lock.Dir())
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	sort.Strings(names)
	say("  %s: pins %s", lock.Dir(), strings.Join(names, " "))
	say("  programs: ingress id %d, egress id %d; members:", ingress, egress)
	for _, m := range ms {
		say("    container %s on host veth %s (ifindex %d), attached with %s", m.ContainerID, m.HostVeth, m.HostIfindex, m.AttachMode)
	}
	return nil
}

func (d *demo) setUpLoopback(n ns.NetNS) error {
	return n.Do(func(ns.NetNS) error {
		h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			return err
		}
		defer h.Close()
		lo, err := h.LinkByName("lo")
		if err != nil {
			return err
		}
		return h.LinkSetUp(lo)
	})
}

func (d *demo) cleanup() error {
	var errs []error
	for _, p := range d.pods {
		if p.active {
			errs = append(errs, d.delPod(p))
		}
		if p.ln != nil {
			p.ln.Close()
		}
		if p.netns != nil {
			p.netns.Close()
			errs = append(errs, testutils.UnmountNS(p.netns))
		}
	}
	if d.node != nil {
		d.node.Close()
		errs = append(errs, testutils.UnmountNS(d.node))
	}
	errs = append(errs, os.RemoveAll(d.pinRoot))
	return errors.Join(errs...)
}

// sweeper runs podfence-sweeper in the node namespace, its output indented.
func (d *demo) sweeper(binDir string, args ...string) error {
	// --pin-root after the command's words and before its other flags:
	// why ends with a port, after which no flag is read.
	i := slices.IndexFunc(args, func(a string) bool { return strings.HasPrefix(a, "-") })
	if i < 0 {
		i = len(args)
	}
	args = slices.Insert(args, i, "--pin-root", d.pinRoot)
	var out []byte
	err := d.node.Do(func(ns.NetNS) error {
		var err error
		out, err = exec.Command(filepath.Join(binDir, "podfence-sweeper"), args...).CombinedOutput()
		return err
	})
	if err != nil {
		return fmt.Errorf("podfence-sweeper %s: %w: %s", strings.Join(args, " "), err, out)
	}
	say("$ podfence-sweeper %s", strings.Join(args, " "))
	for _, line := range strings.Split(strings.TrimRight(string(out), "\n"), "\n") {
		say("  %s", line)
	}
	return nil
}

func step(s string) { fmt.Printf("\n== %s\n", s) }

func say(format string, args ...any) { fmt.Printf("   "+format+"\n", args...) }

func indent(s string) string {
	return "   | " + strings.ReplaceAll(strings.TrimRight(s, "\n"), "\n", "\n   | ") + "\n"
}
