package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/ipproto"
	"github.com/podfence/podfence/pkg/pinroot"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/pkg/policy"
)

// traceEvent is one deny event as trace prints it.
type traceEvent struct {
	Time       time.Time `json:"time"`
	Identifier podid.ID  `json:"identifier,omitempty"` // empty: the veth is no member's any more
	Container  string    `json:"container_id,omitempty"`
	HostVeth   string    `json:"host_veth,omitempty"`
	Ifindex    uint32    `json:"ifindex"`
	Direction  string    `json:"direction"`
	Reason     string    `json:"reason"`
	Protocol   string    `json:"protocol"`
	Src        string    `json:"src"`
	Dst        string    `json:"dst"`
	// Policy names the documents that select the identifier: none of
	// their rules allowed the packet. Empty in strict mode with no
	// selecting document (closed by default).
	Policy []string `json:"policy"`
	// Near are the rules that came closest: their CIDR holds the remote
	// address, but an except excludes it or their ports differ.
	Near []policy.RuleRef `json:"near"`
	// Tier is the cluster policy tier whose Deny dropped the packet, and
	// Rule that Deny as the policy directory's cluster/ now holds it.
	Tier string   `json:"tier,omitempty"`
	Rule *tierRef `json:"rule,omitempty"`
}

// traceSummary ends a trace: how many of the denied packets the kernel
// reported, the rest being rate-limited (one event per millisecond per CPU,
// bursts of 64).
type traceSummary struct {
	Events        int    `json:"events"`
	DeniedPackets uint64 `json:"denied_packets"`
	NotReported   uint64 `json:"not_reported"`
	// DroppedEvents is the datapath's own count of the events it did not
	// write meanwhile (rate limit, or the ring buffer full).
	DroppedEvents  uint64 `json:"dropped_events"`
	DurationMillis int64  `json:"duration_ms"`
}

func cmdTrace(args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlags("trace", stderr, &c, false)
	pod := fs.String("pod", "", "only this identifier (web-7f65cc6544@default) or container ID prefix")
	policyDir := fs.String("policy-dir", defaultPolicyDir, "the plugin's policyDir, to name the documents that selected a denied pod")
	count := fs.Int("count", 0, "stop after this many events (0: until interrupted)")
	duration := fs.Duration("duration", 0, "stop after this long (0: until interrupted)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *count < 0 || *duration < 0 {
		return usageError{errors.New("--count and --duration must not be negative")}
	}
	root, err := openRoot(&c, inspect)
	if err != nil {
		return err
	}
	defer root.Close()
	g, err := root.Global()
	if err != nil {
		return err
	}
	events, err := bpf.OpenDenyEvents(g)
	if err != nil {
		return err
	}
	defer events.Close()

	start := time.Now()
	if *duration > 0 {
		events.SetDeadline(start.Add(*duration))
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sig)
	go func() {
		if _, ok := <-sig; ok {
			events.Close() // a blocked Read returns
		}
	}()

	r := newResolver(root, *policyDir)
	deniedBefore := r.denied()
	droppedBefore, err := g.DroppedEvents()
	if err != nil {
		return err
	}
	toWall := monotonicToWall()
	n := 0
	for *count == 0 || n < *count {
		e, err := events.Read()
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, os.ErrClosed) {
				break
			}
			return err
		}
		te := r.describe(e, toWall(e.Timestamp))
		if *pod != "" && string(te.Identifier) != *pod && !strings.HasPrefix(te.Container, *pod) {
			continue
		}
		n++
		if c.json {
			if err := writeJSONLine(stdout, te); err != nil {
				return err
			}
			continue
		}
		target := string(te.Identifier)
		if target == "" {
			target = fmt.Sprintf("ifindex %d (no member)", te.Ifindex)
		}
		why := "no policy selects it (closed by default)"
		if len(te.Policy) > 0 {
			why = "no rule of " + strings.Join(te.Policy, ", ") + " allows it"
		}
		switch {
		case te.Rule != nil && te.Rule.Policy != "":
			why = te.Reason + " by " + te.Rule.String()
		case te.Reason != bpf.ReasonPolicyDeny.String():
			why = te.Reason
		}
		fmt.Fprintf(stdout, "%s %s %s %s %s -> %s: %s\n", te.Time.Format("15:04:05.000"), target, te.Direction,
			te.Protocol, te.Src, te.Dst, why)
		for _, ref := range te.Near {
			fmt.Fprintf(stdout, "  near: %s\n", describeRule(ref))
		}
	}
	sum := traceSummary{Events: n, DurationMillis: time.Since(start).Milliseconds()}
	if after := r.denied(); after >= deniedBefore {
		sum.DeniedPackets = after - deniedBefore
	}
	if *pod == "" && sum.DeniedPackets > uint64(n) {
		sum.NotReported = sum.DeniedPackets - uint64(n)
	}
	if after, err := g.DroppedEvents(); err == nil && after >= droppedBefore {
		sum.DroppedEvents = after - droppedBefore
	}
	if c.json {
		return writeJSONLine(stdout, map[string]traceSummary{"summary": sum})
	}
	fmt.Fprintf(stderr, "%d events; %d packets denied meanwhile on the node, %d of them not reported; the datapath dropped %d events (rate limit or full ring buffer)\n",
		sum.Events, sum.DeniedPackets, sum.NotReported, sum.DroppedEvents)
	return nil
}

// monotonicToWall converts the CLOCK_MONOTONIC times of deny events to wall
// time, with the offset between the two clocks taken now.
func monotonicToWall() func(time.Duration) time.Time {
	var mono unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &mono)
	offset := time.Duration(time.Now().UnixNano()) - time.Duration(mono.Nano())
	return func(d time.Duration) time.Time { return time.Unix(0, int64(offset+d)) }
}

// resolver names the pod behind a host veth's ifindex, and the documents
// that select it. It re-reads the node's state when it meets an ifindex it
// does not know, at most once a second: pods come and go during a trace.
type resolver struct {
	pins      *pinroot.Root
	policyDir string
	docs      []policy.Document
	cluster   []policy.ClusterDocument
	byIfindex map[uint32]memberOf
	read      time.Time
}

type memberOf struct {
	id       podid.ID
	mode     policy.Mode
	member   memberState
	policies []string
	set      *policy.Set
}

func newResolver(pins *pinroot.Root, policyDir string) *resolver {
	r := &resolver{pins: pins, policyDir: policyDir}
	r.refresh()
	return r
}

func (r *resolver) refresh() {
	r.read = time.Now()
	r.byIfindex = map[uint32]memberOf{}
	idents, err := readIdentifiers(r.pins)
	if err != nil {
		return
	}
	r.docs, r.cluster = nil, nil // unreadable: no names, the rest still shows
	if dir, err := policy.ReadDir(r.policyDir); err == nil {
		r.docs, r.cluster = dir.Documents(), dir.ClusterDocuments()
	}
	for _, s := range idents {
		set := policy.ForIdentifier(r.docs, s.ID, s.Info.Mode).WithCluster(r.cluster, s.ID)
		for _, m := range s.Members {
			r.byIfindex[uint32(m.HostIfindex)] = memberOf{id: s.ID, mode: s.Info.Mode, member: m, policies: set.Sources, set: &set}
		}
	}
}

// denied is the node's denied packet count, over every identifier.
func (r *resolver) denied() uint64 {
	counts, err := readCounters(r.pins)
	if err != nil {
		return 0
	}
	var n uint64
	for _, c := range counts {
		n += c.Denied
	}
	return n
}

func (r *resolver) describe(e bpf.DenyEvent, at time.Time) traceEvent {
	m, ok := r.byIfindex[e.Ifindex]
	if !ok && time.Since(r.read) > time.Second {
		r.refresh()
		m, ok = r.byIfindex[e.Ifindex]
	}
	te := traceEvent{Time: at, Ifindex: e.Ifindex, Direction: "ingress", Reason: e.Reason.String(), Tier: e.Reason.Tier(),
		Protocol: ipproto.Name(e.Proto), Src: e.Src.String(), Dst: e.Dst.String(), Policy: []string{}, Near: []policy.RuleRef{}}
	dir, remote := policy.Ingress, e.Src.Addr()
	if e.Egress {
		te.Direction, dir, remote = "egress", policy.Egress, e.Dst.Addr()
	}
	if ok {
		te.Identifier, te.Container, te.HostVeth = m.id, m.member.ContainerID, m.member.HostVeth
		te.Policy = append(te.Policy, m.policies...)
		if e.Reason == bpf.ReasonPolicyDeny || e.Reason == bpf.ReasonRevoked {
			te.Near = policy.Explain(r.docs, m.id, m.mode, dir, remote, e.Proto, e.Dst.Port()).Near
		}
		if te.Tier != "" {
			// A new flow's first packet: its destination port is the one judged.
			te.Rule = newTierRef(te.Tier, policy.Decide(m.set, &m.set.Cluster, dir, remote, e.Proto, e.Dst.Port()).Rule)
		}
	}
	return te
}

// writeJSONLine writes v as one line: a stream of events reads as JSON
// lines.
func writeJSONLine(w io.Writer, v any) error {
	return json.NewEncoder(w).Encode(v)
}
