package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/attach"
	"github.com/podfence/podfence/test/kernel"
)

// TestAWSAgentLeftovers: a node that ran the AWS network-policy agent
// keeps its filters on the pods' veths (priority 1, handle 1, programs
// named handle_ingress and handle_egress) and its pins. aws-agent names
// them; --remove takes them off and leaves podfence's own hooks, which
// still enforce the policy.
func TestAWSAgentLeftovers(t *testing.T) {
	for _, mode := range attachModes(t) {
		t.Run(mode, func(t *testing.T) {
			c := lcCluster(t, mode)
			_, intruder, web := c.guardedWeb(t)

			// What the agent leaves: a program that lets everything
			// through (so the test sees podfence's verdicts), as the
			// agent's two filters on the web pod's veth, and a pinned map.
			prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SchedCLS, License: "GPL",
				Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()}}) // TC_ACT_UNSPEC
			if err != nil {
				t.Fatal(err)
			}
			defer prog.Close()
			var ifindex int
			if err := c.inNode(func() error {
				l, err := netlink.LinkByName(web.hostVeth)
				if err != nil {
					return err
				}
				ifindex = l.Attrs().Index
				q := &netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: ifindex, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT}, QdiscType: "clsact"}
				if err := netlink.QdiscReplace(q); err != nil {
					return err
				}
				for _, f := range []struct {
					name   string
					parent uint32
				}{{"handle_ingress", netlink.HANDLE_MIN_EGRESS}, {"handle_egress", netlink.HANDLE_MIN_INGRESS}} {
					if err := netlink.FilterAdd(&netlink.BpfFilter{FilterAttrs: netlink.FilterAttrs{LinkIndex: ifindex,
						Parent: f.parent, Handle: 1, Priority: 1, Protocol: unix.ETH_P_ALL}, Fd: prog.FD(), Name: f.name, DirectAction: true}); err != nil {
						return err
					}
				}
				return nil
			}); err != nil {
				t.Fatal(err)
			}
			pinDir := filepath.Join(kernel.PinRoot(t), "globals", "aws")
			if err := os.MkdirAll(filepath.Join(pinDir, "maps"), 0o700); err != nil {
				t.Fatal(err)
			}
			m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 1})
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			if err := m.Pin(filepath.Join(pinDir, "maps", "global_aws_conntrack_map")); err != nil {
				t.Fatal(err)
			}

			run := func(args ...string) string {
				t.Helper()
				out, err := c.sweeper(t, append([]string{"aws-agent", "--aws-pin-dir", pinDir}, args...)...)
				if err != nil {
					t.Fatalf("aws-agent %v: %v\n%s", args, err, out)
				}
				return string(out)
			}
			out := run()
			for _, want := range []string{
				"filter handle_ingress on " + web.hostVeth, "filter handle_egress on " + web.hostVeth,
				"pin " + filepath.Join(pinDir, "maps", "global_aws_conntrack_map"), "2 filters and 1 pins",
			} {
				if !strings.Contains(out, want) {
					t.Errorf("aws-agent does not say %q:\n%s", want, out)
				}
			}
			if out := run("--remove"); !strings.Contains(out, "removed 2 filters and 1 pins") {
				t.Errorf("aws-agent --remove said:\n%s", out)
			}
			if out := run(); !strings.Contains(out, "nothing of the AWS network-policy agent is left") {
				t.Errorf("after --remove, aws-agent said:\n%s", out)
			}
			if exists(pinDir) {
				t.Errorf("%s is still there", pinDir)
			}
			for _, h := range []attach.Hook{attach.HookIngress, attach.HookEgress} {
				if progs, err := c.attached(ifindex, h); err != nil || len(progs) != 1 {
					t.Errorf("%s %s after --remove: programs %v (%v), want podfence's alone", web.hostVeth, h, progs, err)
				}
			}
			if c.connects(intruder, web, backendPort) {
				t.Error("the intruder reaches the web pod after --remove: podfence's hooks went too")
			}
		})
	}
}
