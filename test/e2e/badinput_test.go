package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/vishvananda/netlink"

	"github.com/podfence/podfence/test/netnsutil"
)

// lcTryAdd runs ADD of list for a new pod; the pod is deleted with c's own
// list when the test ends.
func lcTryAdd(t *testing.T, c *cluster, list *libcni.NetworkConfigList, name, namespace string) (*pod, types.Result, error) {
	t.Helper()
	p := &pod{name: name, namespace: namespace, containerID: fmt.Sprintf("lc%06d", podSeq.Add(1)), netns: netnsutil.New(t)}
	t.Cleanup(func() { c.delPodQuiet(p) })
	var res types.Result
	err := c.inNode(func() error {
		var err error
		res, err = c.cni.AddNetworkList(context.Background(), list, c.runtimeConf(p))
		return err
	})
	return p, res, err
}

// lcRequireNothingFrom checks that a failed call left the pin root as it
// was and nothing on the pod's host veth (the node's end of its eth0), and
// that no identifier has the pod as a member.
func lcRequireNothingFrom(t *testing.T, c *cluster, p *pod, before []string) {
	t.Helper()
	if after := lcTree(t, c.pinRoot); !slices.Equal(before, after) {
		t.Errorf("the pin root changed:\nbefore %v\nafter  %v", before, after)
	}
	if p.hostVeth == "" {
		p.hostVeth = lcPeerOfEth0(t, c, p.netns)
	}
	lcRequireGone(t, c, p)
}

// lcAddNonVeth adds an interface that is not a veth, of the first kind
// the kernel has, and returns that kind. A nil h is the calling thread's
// namespace.
func lcAddNonVeth(h *netlink.Handle, name string, index int) (string, error) {
	if h == nil {
		var err error
		if h, err = netlink.NewHandle(); err != nil {
			return "", err
		}
		defer h.Close()
	}
	attrs := netlink.LinkAttrs{Name: name, Index: index}
	var errs []error
	for _, l := range []netlink.Link{&netlink.Dummy{LinkAttrs: attrs}, &netlink.Bridge{LinkAttrs: attrs}, &netlink.Ifb{LinkAttrs: attrs}} {
		err := h.LinkAdd(l)
		if err == nil {
			return l.Type(), nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", l.Type(), err))
	}
	return "", fmt.Errorf("add %s: %w", name, errors.Join(errs...))
}

// TestBadInputThroughRuntime: ADDs a runtime sends with bad configuration,
// bad pod names or a broken policy directory fail with the CNI error code
// and a message that says what to fix, leave no state (ptp has made the
// veth by then), and the runtime's DEL after them succeeds.
func TestBadInputThroughRuntime(t *testing.T) {
	c := lcCluster(t, attachModes(t)[0])
	edit := func(key string, value any) func(map[string]any) {
		return func(pf map[string]any) { pf[key] = value }
	}
	for _, tc := range []struct {
		name      string
		edit      func(pf map[string]any)
		podName   string
		namespace string
		policy    [2]string // file name, content
		keep      string    // "podfence": podfence alone, without ptp
		code      uint
		msgs      []string
	}{
		{name: "unknown key", edit: edit("enforcingMod", "strict"), code: 7, msgs: []string{"unknown config keys enforcingMod"}},
		{name: "bad enforcingMode", edit: edit("enforcingMode", "enforce"), code: 7, msgs: []string{"enforcingMode", `"enforce"`, "standard or strict"}},
		{name: "bad attachMode", edit: edit("attachMode", "xdp"), code: 7, msgs: []string{"attachMode", `"xdp"`}},
		{name: "bad logLevel", edit: edit("logLevel", "verbose"), code: 7, msgs: []string{"logLevel", `"verbose"`}},
		{name: "relative pinRoot", edit: edit("pinRoot", "podfence"), code: 7, msgs: []string{"pinRoot", "absolute path"}},
		{name: "wrong type", edit: edit("policyDir", 42), code: 7, msgs: []string{"decode config"}},
		{name: "missing prevResult", keep: "podfence", code: 7, msgs: []string{"no prevResult", "chained after"}},
		{name: "dot-dot name", podName: "../../etc", code: 4, msgs: []string{`pod name "../../etc"`}},
		{name: "slash name", podName: "a/b", code: 4, msgs: []string{`pod name "a/b"`}},
		{name: "upper case name", podName: "Web_1", code: 4, msgs: []string{`pod name "Web_1"`}},
		{name: "hidden name", podName: ".hidden", code: 4, msgs: []string{`pod name ".hidden"`}},
		{name: "300-character name", podName: strings.Repeat("a", 300), code: 4, msgs: []string{"pod name", "1 to 253 characters"}},
		{name: "dot-dot namespace", namespace: "../kube-system", code: 4, msgs: []string{`pod namespace "../kube-system"`}},
		{name: "more port ranges than the datapath holds", code: 101, policy: [2]string{"ports.yaml", tooManyPorts()},
			msgs: []string{"ports.yaml#0", "10.9.0.0/16", "65 port ranges", "at most 64"}},
		{name: "more distinct port lists than the datapath holds", code: 101, policy: [2]string{"lists.yaml", tooManyPortSets()},
			msgs: []string{"lists.yaml#0", "513 distinct lists", "at most 512"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			list := lcList(t, c, "1.0.0", tc.edit, tc.keep)
			if tc.policy[0] != "" {
				path := filepath.Join(c.policyDir, tc.policy[0])
				if err := os.WriteFile(path, []byte(tc.policy[1]), 0o644); err != nil {
					t.Fatal(err)
				}
				defer os.Remove(path)
			}
			name, namespace := tc.podName, tc.namespace
			if name == "" {
				name = webReplicas[0]
			}
			if namespace == "" {
				namespace = "default"
			}
			before := lcTree(t, c.pinRoot)
			p, res, err := lcTryAdd(t, c, list, name, namespace)
			if err == nil {
				t.Fatalf("ADD succeeded: %v", res)
			}
			lcWantCNIError(t, err, tc.code, tc.msgs...)
			lcRequireNothingFrom(t, c, p, before)
			if tc.keep == "" && p.hostVeth == "" {
				t.Fatal("ptp made no veth: the case tests less than it says")
			}

			// The runtime's DEL after the failed ADD, with the fixed
			// configuration (with the broken one, DEL fails the same way).
			if tc.policy[0] != "" {
				os.Remove(filepath.Join(c.policyDir, tc.policy[0]))
			}
			c.delPod(p)
			lcRequireNothingFrom(t, c, p, before)
		})
	}
	if ids := lcIdentifiers(t, c); len(ids) != 0 {
		t.Errorf("identifiers %v", ids)
	}
}

// TestBadInputDirect: calls no conforming runtime makes, and a pod whose
// veth is not (or no longer) what the primary plugin reported; each fails
// with the CNI error and leaves nothing.
func TestBadInputDirect(t *testing.T) {
	c := lcCluster(t, attachModes(t)[0])
	ptpOnly := lcList(t, c, "1.0.0", nil, "ptp")
	// addPtp gives a pod a veth, address and result from ptp alone.
	addPtp := func(t *testing.T) (*pod, map[string]any) {
		t.Helper()
		p, res, err := lcTryAdd(t, c, ptpOnly, webReplicas[0], "default")
		if err != nil {
			t.Fatal(err)
		}
		r, err := current.NewResultFromResult(res)
		if err != nil {
			t.Fatal(err)
		}
		for _, iface := range r.Interfaces {
			if iface.Sandbox == "" {
				p.hostVeth = iface.Name
			}
		}
		return p, lcJSONMap(t, res)
	}
	// add is the chain's ADD for podfence, in the pod's own namespace
	// unless netns names another.
	add := func(t *testing.T, p *pod, prev map[string]any, netns ...string) error {
		t.Helper()
		call := p.lcCall(c, "ADD")
		call.conf = withPrev(call.conf, prev)
		if len(netns) > 0 {
			call.netns = netns[0]
		}
		_, err := lcExec(t, c, call)
		return err
	}
	// del is the runtime's DEL after the failed ADD.
	del := func(t *testing.T, p *pod, prev map[string]any) {
		t.Helper()
		call := p.lcCall(c, "DEL")
		call.conf = withPrev(call.conf, prev)
		if _, err := lcExec(t, c, call); err != nil {
			t.Errorf("DEL after the failed ADD: %v", err)
		}
	}
	inPod := func(t *testing.T, p *pod, fn func(h *netlink.Handle) error) {
		t.Helper()
		netnsutil.Do(t, p.netns, func() error {
			h, err := netlink.NewHandle()
			if err != nil {
				return err
			}
			defer h.Close()
			return fn(h)
		})
	}

	t.Run("empty CNI_NETNS", func(t *testing.T) {
		p, prev := addPtp(t)
		before := lcTree(t, c.pinRoot)
		lcWantCNIError(t, add(t, p, prev, ""), types.ErrInvalidEnvironmentVariables, "CNI_NETNS")
		lcRequireNothingFrom(t, c, p, before)
		del(t, p, prev)
	})
	t.Run("CNI_NETNS missing", func(t *testing.T) {
		p, prev := addPtp(t)
		before := lcTree(t, c.pinRoot)
		lcWantCNIError(t, add(t, p, prev, "/var/run/netns/podfence-no-such-namespace"), types.ErrInvalidNetNS, "podfence-no-such-namespace")
		lcRequireNothingFrom(t, c, p, before)
		del(t, p, prev)
	})
	t.Run("veth deleted", func(t *testing.T) {
		p, prev := addPtp(t)
		lcDeleteHostVeth(t, c, p)
		before := lcTree(t, c.pinRoot)
		lcWantCNIError(t, add(t, p, prev), types.ErrInvalidNetNS, "find the pod's veth", "eth0")
		lcRequireNothingFrom(t, c, p, before)
		del(t, p, prev)
		lcRequireNothingFrom(t, c, p, before)
	})
	t.Run("eth0 not a veth", func(t *testing.T) {
		p, prev := addPtp(t)
		lcDeleteHostVeth(t, c, p)
		var kind string
		inPod(t, p, func(h *netlink.Handle) error {
			var err error
			kind, err = lcAddNonVeth(h, "eth0", 0)
			return err
		})
		before := lcTree(t, c.pinRoot)
		lcWantCNIError(t, add(t, p, prev), types.ErrInvalidNetNS, "eth0", "is a "+kind+", not a veth")
		lcRequireNothingFrom(t, c, p, before)
		del(t, p, prev)
	})
	t.Run("veth not the reported one", func(t *testing.T) {
		p, prev := addPtp(t)
		reported := p.hostVeth
		if err := c.inNode(func() error {
			l, err := netlink.LinkByName(p.hostVeth)
			if err != nil {
				return err
			}
			return netlink.LinkSetName(l, "renamed0")
		}); err != nil {
			t.Fatal(err)
		}
		p.hostVeth = "renamed0"
		before := lcTree(t, c.pinRoot)
		lcWantCNIError(t, add(t, p, prev), types.ErrInvalidNetNS, "renamed0", reported)
		lcRequireNothingFrom(t, c, p, before)
		del(t, p, prev)
	})
	// eth0's peer is in another namespace than the plugin's, and an
	// unrelated interface of the node has the peer's index. A primary
	// plugin that reports no host interface gives nothing to compare
	// names with: podfence must still not attach to the stranger.
	t.Run("peer in another namespace", func(t *testing.T) {
		const index = 4242
		other := netnsutil.New(t)
		p := &pod{name: webReplicas[0], namespace: "default", containerID: fmt.Sprintf("lc%06d", podSeq.Add(1)), netns: netnsutil.New(t), hostVeth: "stranger0"}
		netnsutil.Do(t, other, func() error {
			return netlink.LinkAdd(&netlink.Veth{
				LinkAttrs:     netlink.LinkAttrs{Name: "vother", Index: index},
				PeerName:      "eth0",
				PeerNamespace: netlink.NsFd(int(p.netns.Fd())),
			})
		})
		if err := c.inNode(func() error {
			_, err := lcAddNonVeth(nil, "stranger0", index)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if idx := lcIfindex(t, c, "stranger0"); idx != index {
			t.Fatalf("the stranger has index %d, want %d", idx, index)
		}
		prev := map[string]any{
			"cniVersion": "1.0.0",
			"interfaces": []any{map[string]any{"name": "eth0", "sandbox": p.netns.Path()}},
			"ips":        []any{map[string]any{"address": "10.99.0.2/24", "interface": 0}},
		}
		before := lcTree(t, c.pinRoot)
		err := add(t, p, prev)
		if err == nil {
			defer del(t, p, prev)
		}
		lcWantCNIError(t, err, types.ErrInvalidNetNS, "peer of eth0", "not in this namespace", "stranger0")
		lcRequireNothingFrom(t, c, p, before)
		// And with the name the primary plugin reported.
		prev["interfaces"] = append(prev["interfaces"].([]any), map[string]any{"name": "vother"})
		lcWantCNIError(t, add(t, p, prev), types.ErrInvalidNetNS, "peer of eth0", "not in this namespace")
		lcRequireNothingFrom(t, c, p, before)
		if err == nil {
			return
		}
		del(t, p, prev)
	})
	if ids := lcIdentifiers(t, c); len(ids) != 0 {
		t.Errorf("identifiers %v", ids)
	}
}

// tooManyPorts selects the web replicas with one CIDR and 65 separate ports,
// one more than a datapath entry holds.
func tooManyPorts() string {
	var ports []uint16
	for i := uint16(0); i < 65; i++ {
		ports = append(ports, 1000+2*i)
	}
	return endpointDoc{
		name: "ports", pods: []string{webReplicas[0]}, isolate: []string{"Ingress"},
		ingress: []docRule{tcpRule("10.9.0.0/16", ports...)},
	}.String()
}

// tooManyPortSets allows 513 peers three ports each, every peer others.
func tooManyPortSets() string {
	var rules []docRule
	for i := range 513 {
		p := uint16(6 * i) // not adjacent, or they merge into one range
		rules = append(rules, tcpRule(fmt.Sprintf("10.9.%d.%d/32", i/256, i%256), p+1, p+3, p+5))
	}
	return endpointDoc{
		name: "lists", pods: []string{webReplicas[0]}, isolate: []string{"Ingress"},
		ingress: rules,
	}.String()
}
