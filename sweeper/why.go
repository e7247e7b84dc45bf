package main

import (
	"errors"
	"fmt"
	"io"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/ctnetlink"
	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/packet"

	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/pkg/policy"
)

// whyResult is what `why` prints with --json.
type whyResult struct {
	Identifier  podid.ID           `json:"identifier"`
	Container   string             `json:"container_id"`
	Direction   string             `json:"direction"`
	Protocol    string             `json:"protocol"`
	Src         string             `json:"src"`
	Dst         string             `json:"dst"`
	Verdict     string             `json:"verdict"` // allow or deny
	Reason      string             `json:"reason"`
	Explanation policy.Explanation `json:"explanation"`
	// Tier is the cluster rule that decided (reasons admin-* and
	// baseline-*), Passed the Admin Pass that sent the flow on; from the
	// policy directory's cluster/.
	Tier   *tierRef `json:"tier,omitempty"`
	Passed *tierRef `json:"passed,omitempty"`
	// ServiceFrontend: the destination is a Service frontend of the node's
	// services map, and the identifier judges Services on their backends:
	// a new flow to it is judged on the backend kube-proxy picks, not as
	// the verdict above says of the frontend itself.
	ServiceFrontend bool `json:"service_frontend,omitempty"`
	// Backends are, for a ServiceFrontend, the backends the kernel's
	// conntrack holds flows to it translated to (those kube-proxy picked
	// for this node's flows so far), each with the verdict of a new flow
	// from the pod to it: what the judge after the translation decides
	// for a flow that lands there.
	Backends []whyBackend `json:"backends,omitempty"`

	reason bpf.Reason
	own    []string // the member's addresses
}

// whyBackend is a Service backend and a new flow's verdict on it.
type whyBackend struct {
	Backend string `json:"backend"`
	Verdict string `json:"verdict"`
	Reason  string `json:"reason"`
}

// whyProtocols are the protocols a trial packet can be built for.
var whyProtocols = map[string]uint8{"tcp": 6, "udp": 17, "sctp": 132}

func cmdWhy(args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlags("why", stderr, &c, false)
	pod := fs.String("pod", "", "the pod: NAME.NAMESPACE (NAME alone: namespace default), or an identifier NAME@NAMESPACE")
	from := fs.String("from", "", "a connection from this address to the pod (ingress)")
	to := fs.String("to", "", "a connection from the pod to this address (egress)")
	source := fs.String("source", "", "with --to: the source address of the pod's packet (default: the pod's own), as trace shows a spoofed one")
	policyDir := fs.String("policy-dir", defaultPolicyDir, "the plugin's policyDir, to name the rules that decide")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: podfence-sweeper why --pod POD (--from|--to) ADDR PORT/PROTO\n\n"+
			"Runs the pod's datapath program on a packet of a new connection, against the live\n"+
			"policy maps and a copy of its conntrack entries (nothing on the node changes),\n"+
			"and says what it decides, why, and which rules of the policy directory decide it.\n\n")
		fs.PrintDefaults()
	}
	rest, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	q, err := parseWhy(*pod, *from, *to, *source, rest)
	if err != nil {
		return usageError{err}
	}
	root, err := openRoot(&c, inspect)
	if err != nil {
		return err
	}
	defer root.Close()
	// One hold of the identifier's lock: the member the packet is built
	// for is the one whose pins it meets.
	lock, err := root.Lock(q.id)
	if errors.Is(err, membership.ErrNoIdentifier) {
		return fmt.Errorf("no identifier %s on this node", q.id)
	}
	if err != nil {
		return err
	}
	defer lock.Unlock()
	s, err := readHeld(lock)
	if err != nil {
		return err
	}
	mode, member, podAddr, err := q.member(s)
	if err != nil {
		return err
	}
	pkt := packet.Packet{Src: q.peer, Dst: podAddr, Proto: q.proto, SrcPort: 40000, DstPort: q.port, TCPFlags: 0x02}
	if q.dir == policy.Egress {
		pkt.Src, pkt.Dst = podAddr, q.peer
		if q.source.IsValid() {
			pkt.Src = q.source
		}
	}
	// why changes nothing on the node: it runs what is pinned.
	ident, err := lock.OpenExisting()
	if err != nil {
		return err
	}
	defer ident.Close()
	ret, reason, err := ident.Trial(q.dir, pkt.Marshal(), uint32(member.HostIfindex))
	if err != nil {
		return err
	}
	var docs []policy.Document
	var cluster []policy.ClusterDocument
	if dir, err := policy.ReadDir(*policyDir); err != nil {
		fmt.Fprintf(stderr, "the policy directory cannot be read (%v): the verdict is the datapath's, no rule can be named\n", err)
	} else {
		docs, cluster = dir.Documents(), dir.ClusterDocuments()
	}
	set := policy.ForIdentifier(docs, q.id, mode).WithCluster(cluster, q.id)
	decision := policy.Decide(&set, &set.Cluster, q.dir, q.peer, q.proto, q.port)
	res := whyResult{Identifier: q.id, Container: member.ContainerID, Direction: q.dir.String(),
		Protocol: policy.Protocol(q.proto).String(),
		Src:      netip.AddrPortFrom(pkt.Src, pkt.SrcPort).String(), Dst: netip.AddrPortFrom(pkt.Dst, pkt.DstPort).String(),
		Verdict: "allow", Reason: reason.String(), reason: reason,
		Explanation: policy.Explain(docs, q.id, mode, q.dir, q.peer, q.proto, q.port),
		own:         prefixStrings(member.IPs)}
	if reason.Tier() != "" {
		res.Tier = newTierRef(reason.Tier(), decision.Rule)
	}
	if decision.Passed != nil {
		res.Passed = newTierRef(policy.TierAdmin.String(), decision.Passed)
	}
	if ret != bpf.VerdictAllow {
		res.Verdict = "deny"
	}
	if q.dir == policy.Egress && ident.Slot >= 0 {
		if g, err := root.Global(); err == nil {
			res.ServiceFrontend, _ = g.IsFrontend(bpf.Frontend{Addr: q.peer, Port: q.port, Proto: q.proto})
		}
	}
	if res.ServiceFrontend {
		backends, err := translatedTo(netip.AddrPortFrom(q.peer, q.port), q.proto)
		if err != nil {
			fmt.Fprintf(stderr, "the kernel's conntrack cannot be read (%v): no backend of %s can be named\n", err, res.Dst)
		}
		for _, b := range backends {
			pkt.Dst, pkt.DstPort = b.Addr(), b.Port()
			ret, reason, err := ident.Trial(q.dir, pkt.Marshal(), uint32(member.HostIfindex))
			if err != nil {
				return err
			}
			v := whyBackend{Backend: b.String(), Verdict: "allow", Reason: reason.String()}
			if ret != bpf.VerdictAllow {
				v.Verdict = "deny"
			}
			res.Backends = append(res.Backends, v)
		}
	}
	if c.json {
		return writeJSON(stdout, res)
	}
	printWhy(stdout, res)
	return nil
}

func printWhy(w io.Writer, r whyResult) {
	fmt.Fprintf(w, "%s %s %s %s -> %s: %s (%s)\n", r.Identifier, r.Direction, r.Protocol, r.Src, r.Dst, r.Verdict, r.Reason)
	e := r.Explanation
	switch r.reason {
	case bpf.ReasonNotIsolated:
		fmt.Fprintf(w, "  no policy isolates the pod's %s\n", r.Direction)
	case bpf.ReasonNode:
		fmt.Fprintf(w, "  the peer is one of the node's own addresses, always allowed\n")
	case bpf.ReasonSpoofed:
		fmt.Fprintf(w, "  the source is not one of the pod's own addresses (%s): a pod speaks only for itself (the plugin's sourceCheck)\n", strings.Join(r.own, ", "))
		return // policy was not consulted
	case bpf.ReasonCTEstablished, bpf.ReasonCTReply:
		fmt.Fprintf(w, "  a flow in conntrack, checked against the current policy\n")
	case bpf.ReasonAdminAccept, bpf.ReasonAdminDeny, bpf.ReasonBaselineAccept, bpf.ReasonBaselineDeny:
		if r.Tier.Policy == "" {
			fmt.Fprintf(w, "  decided by a %s tier rule the policy directory no longer holds\n", r.Tier.Tier)
		} else {
			fmt.Fprintf(w, "  decided by %s\n", r.Tier)
		}
	case bpf.ReasonPolicyDeny:
		if len(e.Documents) == 0 {
			fmt.Fprintf(w, "  no policy selects the pod, and its mode closes it by default\n")
		} else {
			fmt.Fprintf(w, "  no rule of %s allows it\n", strings.Join(e.Documents, ", "))
		}
	}
	if r.Passed != nil {
		fmt.Fprintf(w, "  passed on by %s\n", r.Passed)
	}
	for _, ref := range e.Allowing {
		fmt.Fprintf(w, "  allowed by %s\n", describeRule(ref))
	}
	if r.Verdict == "deny" {
		for _, ref := range e.Near {
			fmt.Fprintf(w, "  near: %s\n", describeRule(ref))
		}
	}
	for _, p := range e.NotAsWritten {
		fmt.Fprintf(w, "  not enforced as written: %s\n", p)
	}
	if r.ServiceFrontend {
		fmt.Fprintf(w, "  %s is a Service frontend: a new flow to it is judged on the backend kube-proxy translates it to, not as above\n", r.Dst)
		if len(r.Backends) == 0 {
			fmt.Fprintf(w, "  no flow the kernel's conntrack holds names its backends yet: ask why --to <backend>\n")
		}
		for _, b := range r.Backends {
			fmt.Fprintf(w, "  translated to %s: %s (%s)\n", b.Backend, b.Verdict, b.Reason)
		}
	}
}

// translatedTo lists the backends the kernel's conntrack holds flows to
// frontend translated to, in order.
func translatedTo(frontend netip.AddrPort, proto uint8) ([]netip.AddrPort, error) {
	seen := map[netip.AddrPort]bool{}
	err := ctnetlink.Dump(func(f *ctnetlink.Flow) error {
		if f.Orig.Proto != proto || f.Orig.Destination() != frontend {
			return nil
		}
		if b := f.Reply.Source(); b != frontend {
			seen[b] = true
		}
		return nil
	})
	backends := slices.SortedFunc(maps.Keys(seen), func(a, b netip.AddrPort) int { return a.Compare(b) })
	return backends, err
}

// tierRef names a cluster rule in why's answer.
type tierRef struct {
	Tier     string `json:"tier"`
	Policy   string `json:"policy"` // the ClusterNetworkPolicy
	Priority uint16 `json:"priority"`
	Action   string `json:"action"`
	Source   string `json:"source"` // file#document
	Rule     int    `json:"rule"`   // index in the document's ingress or egress
	CIDR     string `json:"cidr"`
	Ports    string `json:"ports"`
}

// newTierRef names r, a rule of tier; without one (the directory changed
// since the maps were programmed) only the tier.
func newTierRef(tier string, r *policy.ClusterRule) *tierRef {
	if r == nil {
		return &tierRef{Tier: tier}
	}
	var ports []string
	for _, p := range r.Ports {
		ports = append(ports, p.String())
	}
	return &tierRef{Tier: tier, Policy: r.Policy, Priority: r.Priority, Action: r.Action.String(),
		Source: r.Source, Rule: r.Index, CIDR: r.CIDR.String(), Ports: strings.Join(ports, ",")}
}

func (t *tierRef) String() string {
	return fmt.Sprintf("%s tier: %s priority %d (%s) rule %d: %s %s %s", t.Tier, t.Policy, t.Priority, t.Source, t.Rule, t.Action, t.CIDR, t.Ports)
}

func describeRule(ref policy.RuleRef) string {
	s := fmt.Sprintf("%s/%s (%s) rule %d: %s", ref.Namespace, ref.Name, ref.Source, ref.Rule, ref.CIDR)
	switch {
	case ref.Except != nil:
		s += " except " + ref.Except.String() + ", which holds the address"
	case ref.Ports != nil:
		s += " " + ref.Ports.String()
	default:
		s += ", but not this port"
	}
	return s
}

// whyQuery is a parsed `why` command line.
type whyQuery struct {
	id    podid.ID
	dir   policy.Direction
	peer  netip.Addr
	proto uint8
	port  uint16
	// source, when valid, is the source of an egress packet in place of
	// the pod's own address.
	source netip.Addr
}

func parseWhy(pod, from, to, source string, rest []string) (whyQuery, error) {
	var q whyQuery
	var err error
	switch {
	case pod == "":
		return q, errors.New("--pod is required")
	case strings.Contains(pod, "@"):
		if !podid.Valid(pod) {
			return q, fmt.Errorf("--pod %q: not a valid identifier", pod)
		}
		q.id = podid.ID(pod)
	default:
		// A namespace is a DNS label: it has no dots, a pod name may.
		name, ns := pod, "default"
		if i := strings.LastIndexByte(pod, '.'); i >= 0 {
			name, ns = pod[:i], pod[i+1:]
		}
		if q.id, err = podid.FromPod(name, ns); err != nil {
			return q, fmt.Errorf("--pod %q: %w", pod, err)
		}
	}
	addr := from
	q.dir = policy.Ingress
	switch {
	case (from == "") == (to == ""):
		return q, errors.New("say --from ADDR (a connection to the pod) or --to ADDR (from it), one of them")
	case to != "":
		addr, q.dir = to, policy.Egress
	}
	if q.peer, err = netip.ParseAddr(addr); err != nil {
		return q, fmt.Errorf("%s: %w", addr, err)
	}
	q.peer = q.peer.Unmap()
	if source != "" {
		if q.dir != policy.Egress {
			return q, errors.New("--source goes with --to: it is the source of the pod's own packet")
		}
		if q.source, err = netip.ParseAddr(source); err != nil {
			return q, fmt.Errorf("--source %s: %w", source, err)
		}
		if q.source = q.source.Unmap(); q.source.Is4() != q.peer.Is4() {
			return q, fmt.Errorf("--source %s is not of the family of %s", source, to)
		}
	}
	if len(rest) != 1 {
		return q, errors.New("say the port and protocol once, as in 8080/tcp")
	}
	portStr, protoStr, ok := strings.Cut(rest[0], "/")
	if !ok {
		protoStr = "tcp"
	}
	var known bool
	if q.proto, known = whyProtocols[strings.ToLower(protoStr)]; !known {
		return q, fmt.Errorf("%s: protocol %q, want tcp, udp or sctp", rest[0], protoStr)
	}
	p, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil || p == 0 {
		return q, fmt.Errorf("%s: port %q, want 1-65535", rest[0], portStr)
	}
	q.port = uint16(p)
	return q, nil
}

// member finds the identifier's mode, a member of it whose veth is present,
// and that member's address of the peer's family.
func (q whyQuery) member(s identState) (policy.Mode, memberState, netip.Addr, error) {
	for _, m := range s.Members {
		if !m.VethPresent {
			continue
		}
		for _, p := range m.IPs {
			if p.Addr().Is4() == q.peer.Is4() {
				return s.Info.Mode, m, p.Addr(), nil
			}
		}
	}
	return "", memberState{}, netip.Addr{}, fmt.Errorf("identifier %s has no member with a veth and an IPv%d address", q.id, map[bool]int{true: 4, false: 6}[q.peer.Is4()])
}

// prefixStrings prints addresses as the member record has them.
func prefixStrings(ps []netip.Prefix) []string {
	out := make([]string, 0, len(ps))
	for _, p := range ps {
		out = append(out, p.String())
	}
	return out
}
