package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/ipproto"
	"github.com/podfence/podfence/pkg/liveness"
	"github.com/podfence/podfence/pkg/nodeaddr"
	"github.com/podfence/podfence/pkg/pinroot"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/pkg/sweep"
)

// identifierView is one identifier as ls shows it.
type identifierView struct {
	ID         podid.ID `json:"identifier"`
	Generation uint32   `json:"generation"`
	// Layout is the layout version and build the pins record (README,
	// "Upgrading"), e.g. "v1 object=2cd96be453afbd0a".
	Layout   string   `json:"layout"`
	Mode     string   `json:"mode"`
	Isolated []string `json:"isolated"`
	// Tiers are the cluster policy tiers that judge the identifier's new
	// flows, by direction: "admin/ingress", "baseline/egress".
	Tiers []string `json:"tiers"`
	// ServicesJudged says where the identifier's flows to Services are
	// judged: "backend" (after the translation, README "Judging egress
	// after Service translation") or "frontend" (at the veth, on the
	// Service's address: a kernel without the conntrack kfuncs).
	ServicesJudged string       `json:"services_judged,omitempty"`
	Allowed        uint64       `json:"allowed_packets"`
	Denied         uint64       `json:"denied_packets"`
	Members        []memberView `json:"members"`
	Unreadable     []string     `json:"unreadable_members,omitempty"`
	Error          string       `json:"error,omitempty"`
	// PolicyError is why the policy directory was refused, node-wide:
	// Generation is then the last good policy's.
	PolicyError      string     `json:"policy_error,omitempty"`
	PolicyErrorSince *time.Time `json:"policy_error_since,omitempty"`
	// PolicyProblems are, node-wide, what the policy directory's documents
	// say that podfence does not enforce as written: documents that do
	// not parse and what is enforced instead, rules left out (allowing
	// nothing), fields ignored.
	PolicyProblems []string `json:"policy_problems,omitempty"`
}

type memberView struct {
	ContainerID string   `json:"container_id"`
	IfName      string   `json:"ifname"`
	HostVeth    string   `json:"host_veth"`
	HostIfindex int      `json:"host_ifindex"`
	IPs         []string `json:"ips"`
	AttachMode  string   `json:"attach_mode"`
	VethPresent bool     `json:"veth_present"`
	// Attached: both of the identifier's programs are on the veth.
	Attached bool `json:"attached"`
}

func cmdLs(args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlags("ls", stderr, &c, false)
	if err := parse(fs, args); err != nil {
		return err
	}
	root, err := openRoot(&c, records)
	if err != nil {
		return err
	}
	defer root.Close()
	idents, err := readIdentifiers(root)
	if err != nil {
		return err
	}
	views := []identifierView{}
	for _, s := range idents {
		views = append(views, s.view())
	}
	ps, recorded, err := root.ReadPolicyStatus()
	if err != nil {
		return err
	}
	problems := ps.Problems
	if ps.More > 0 {
		problems = append(problems, fmt.Sprintf("... and %d more", ps.More))
	}
	if recorded {
		for i := range views {
			if ps.Error != "" {
				views[i].PolicyError, views[i].PolicyErrorSince = ps.Error, &ps.Since
			}
			views[i].PolicyProblems = problems
		}
	}
	if c.json {
		return writeJSON(stdout, views)
	}
	if ps.Error != "" {
		fmt.Fprintf(stdout, "policy directory refused since %s (every identifier keeps its last good policy): %s\n\n",
			ps.Since.Local().Format(time.RFC3339), ps.Error)
	}
	if len(problems) > 0 {
		fmt.Fprintf(stdout, "policy not enforced as written (since %s):\n", ps.Since.Local().Format(time.RFC3339))
		for _, p := range problems {
			fmt.Fprintf(stdout, "  %s\n", p)
		}
		fmt.Fprintln(stdout)
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "IDENTIFIER\tGEN\tMODE\tISOLATED\tTIERS\tALLOWED\tDENIED\tCONTAINER\tVETH\tIFINDEX\tATTACH\tPROGRAMS\tIPS")
	orNone := func(s []string) string {
		if len(s) == 0 {
			return "-"
		}
		return strings.Join(s, ",")
	}
	for _, v := range views {
		head := fmt.Sprintf("%s\t%d\t%s\t%s\t%s\t%d\t%d", v.ID, v.Generation, v.Mode, orNone(v.Isolated), orNone(v.Tiers), v.Allowed, v.Denied)
		if v.Error != "" {
			fmt.Fprintf(tw, "%s\t(%s)\n", head, v.Error)
		}
		if len(v.Members) == 0 && v.Error == "" {
			fmt.Fprintf(tw, "%s\t-\t-\t-\t-\t-\t-\n", head)
		}
		for _, m := range v.Members {
			progs := "attached"
			switch {
			case !m.VethPresent:
				progs = "veth gone"
			case !m.Attached:
				progs = "MISSING"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\n", head, shortID(m.ContainerID), m.HostVeth, m.HostIfindex, m.AttachMode, progs, strings.Join(m.IPs, ","))
		}
		for _, key := range v.Unreadable {
			fmt.Fprintf(tw, "%s\t%s\t(unreadable record)\t-\t-\t-\t-\n", head, key)
		}
	}
	return tw.Flush()
}

func shortID(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}

// identCounters are an identifier's packet counts.
type identCounters struct {
	ID              podid.ID
	Allowed, Denied uint64
}

// readCounters reads every identifier's packet counts, without its lock and
// without a look at its members (netlink, hooks): what the metrics and
// trace's totals need, at every scrape or event batch. An identifier being
// created or removed is left out.
func readCounters(pins *pinroot.Root) ([]identCounters, error) {
	ids, err := pins.Identifiers()
	if err != nil {
		return nil, err
	}
	var out []identCounters
	for _, id := range ids {
		info, err := pins.Peek(id)
		if err != nil {
			continue
		}
		out = append(out, identCounters{ID: id, Allowed: info.Counters.Allowed(), Denied: info.Counters.Denied()})
	}
	return out, nil
}

// entryView is one conntrack entry as dump and sweep show it.
type entryView struct {
	Family     int    `json:"family"`
	Proto      string `json:"proto"`
	Pod        string `json:"pod"` // the owner: address and port
	Peer       string `json:"peer"`
	Ifindex    uint32 `json:"ifindex"`
	Owner      string `json:"owner,omitempty"` // identifier and container of the veth
	AgeSeconds string `json:"age"`
	Generation uint32 `json:"generation"`
	Flags      string `json:"flags"`
	Decision   string `json:"decision,omitempty"`
	Reason     string `json:"reason,omitempty"`
}

func viewEntry(e *bpf.CTEntry, now time.Duration, own map[uint32]owner) entryView {
	flags := []string{}
	if e.Value.Flags&bpf.CTEgress != 0 {
		flags = append(flags, "pod-opened")
	} else {
		flags = append(flags, "peer-opened")
	}
	if e.Value.Flags&bpf.CTNode != 0 {
		flags = append(flags, "node")
	}
	return entryView{
		Family:     int(e.Key.Family),
		Proto:      ipproto.Name(e.Key.Proto),
		Pod:        e.Key.SrcAddrPort().String(),
		Peer:       e.Key.DstAddrPort().String(),
		Ifindex:    e.Ifindex,
		Owner:      own[e.Ifindex].String(),
		AgeSeconds: fmt.Sprintf("%.1fs", (now - e.LastSeen()).Seconds()),
		Generation: e.Value.Generation,
		Flags:      strings.Join(flags, ","),
	}
}

func cmdDumpConntrack(args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlags("dump conntrack", stderr, &c, false)
	pod := fs.String("pod", "", "only entries whose owner's identifier or container ID starts with this")
	addr := fs.String("addr", "", "only entries with this address on either side")
	if err := parse(fs, args); err != nil {
		return err
	}
	var want netip.Addr
	if *addr != "" {
		a, err := netip.ParseAddr(*addr)
		if err != nil {
			return usageError{fmt.Errorf("--addr: %w", err)}
		}
		want = a.Unmap()
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
	own := owners(root)
	now := sweep.Monotonic()
	views := []entryView{}
	err = g.ScanConntrack(func(batch []bpf.CTEntry) error {
		for i := range batch {
			e := &batch[i]
			if want.IsValid() && e.Key.SrcAddrPort().Addr() != want && e.Key.DstAddrPort().Addr() != want {
				continue
			}
			v := viewEntry(e, now, own)
			if *pod != "" && !own[e.Ifindex].matches(*pod) {
				continue
			}
			views = append(views, v)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if c.json {
		return writeJSON(stdout, views)
	}
	return writeEntries(stdout, views, false)
}

func writeEntries(w io.Writer, views []entryView, decisions bool) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	head := "PROTO\tPOD\tPEER\tIFINDEX\tOWNER\tAGE\tGEN\tFLAGS"
	if decisions {
		head += "\tDECISION\tREASON"
	}
	fmt.Fprintln(tw, head)
	for _, v := range views {
		owner := v.Owner
		if owner == "" {
			owner = "-"
		}
		line := fmt.Sprintf("%s\t%s\t%s\t%d\t%s\t%s\t%d\t%s", v.Proto, v.Pod, v.Peer, v.Ifindex, owner, v.AgeSeconds, v.Generation, v.Flags)
		if decisions {
			line += "\t" + v.Decision + "\t" + v.Reason
		}
		fmt.Fprintln(tw, line)
	}
	return tw.Flush()
}

// sweepView is sweep's output.
type sweepView struct {
	DurationMS  float64        `json:"duration_ms"`
	KernelFlows int            `json:"kernel_flows"`
	Scanned     int            `json:"scanned"`
	Kept        map[string]int `json:"kept"`
	Deleted     map[string]int `json:"deleted"`
	Fill        [2]float64     `json:"fill"`
	Orphans     []orphanView   `json:"orphans_removed"`
	Entries     []entryView    `json:"entries"`
}

type orphanView struct {
	Identifier        podid.ID `json:"identifier"`
	ContainerID       string   `json:"container_id"`
	HostVeth          string   `json:"host_veth"`
	IdentifierRemoved bool     `json:"identifier_removed"`
}

func cmdSweep(args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlags("sweep", stderr, &c, true)
	if err := parse(fs, args); err != nil {
		return err
	}
	c.warnGrace(stderr)
	root, err := openRoot(&c, inspect)
	if err != nil {
		return err
	}
	defer root.Close()
	s, err := sweep.New(root, sweep.Options{Grace: c.grace, OrphanGrace: c.orphanGrace, Record: true, Log: discardLog()})
	if err != nil {
		return err
	}
	defer s.Close()
	own := owners(root) // before the pass: an orphan's entries still name it
	rep, err := s.Pass()
	if err != nil {
		return err
	}
	now := sweep.Monotonic()
	v := sweepView{
		DurationMS: float64(rep.Duration.Microseconds()) / 1000, KernelFlows: rep.KernelFlows, Scanned: rep.Scanned,
		Kept: map[string]int{}, Deleted: map[string]int{}, Fill: rep.Fill, Orphans: []orphanView{}, Entries: []entryView{},
	}
	for r, n := range rep.Count {
		reason := liveness.Reason(r)
		if reason.Delete() {
			v.Deleted[reason.String()] = n
		} else {
			v.Kept[reason.String()] = n
		}
	}
	for _, o := range rep.Orphans {
		v.Orphans = append(v.Orphans, orphanView{o.ID, o.Member.ContainerID, o.Member.HostVeth, o.Identifier})
	}
	for _, d := range rep.Decisions {
		ev := viewEntry(&d.Entry, now, own)
		ev.Decision = "kept"
		if d.Reason.Delete() {
			ev.Decision = "deleted"
		}
		ev.Reason = d.Reason.String()
		v.Entries = append(v.Entries, ev)
	}
	if c.json {
		return writeJSON(stdout, v)
	}
	fmt.Fprintf(stdout, "pass: %.1f ms, %d kernel flows, %d entries scanned, conntrack maps %.1f%% (v4) and %.1f%% (v6) full\n",
		v.DurationMS, v.KernelFlows, v.Scanned, 100*v.Fill[0], 100*v.Fill[1])
	fmt.Fprintf(stdout, "kept: %s\ndeleted: %s\n", counts(v.Kept), counts(v.Deleted))
	for _, o := range v.Orphans {
		fmt.Fprintf(stdout, "removed orphan: %s container %s (veth %s gone)%s\n", o.Identifier, shortID(o.ContainerID), o.HostVeth,
			map[bool]string{true: ", and the identifier's pins", false: ""}[o.IdentifierRemoved])
	}
	if len(v.Entries) > 0 {
		fmt.Fprintln(stdout)
		return writeEntries(stdout, v.Entries, true)
	}
	return nil
}

// orphanGraceOnce: one sweep has no memory of when a veth went, so the
// grace counts from now unless it is 0 (remove at once).
func counts(m map[string]int) string {
	var parts []string
	for _, r := range []liveness.Reason{liveness.KeptRecent, liveness.KeptGrace, liveness.KeptLive, liveness.DeletedGone, liveness.DeletedDead} {
		if n, ok := m[r.String()]; ok {
			parts = append(parts, fmt.Sprintf("%d %s", n, r))
		}
	}
	return strings.Join(parts, ", ")
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func cmdApply(args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlags("apply", stderr, &c, false)
	policyDir := fs.String("policy-dir", defaultPolicyDir, "the plugin's policyDir")
	if err := parse(fs, args); err != nil {
		return err
	}
	root, err := openRoot(&c, upgrade)
	if err != nil {
		return err
	}
	defer root.Close()
	g, err := root.Global()
	if err != nil {
		return err
	}
	// The node's addresses go into every identifier's tries with the
	// policy, as run writes them: read them now, not at the last ADD.
	if err := g.SyncNodeAddrs(nodeaddr.List); err != nil {
		return err
	}
	a, err := root.ReapplyPolicies(*policyDir, policy.Digest{})
	if err != nil {
		return err
	}
	if a.KeepErr != nil {
		fmt.Fprintf(stderr, "last good versions not recorded: %v\n", a.KeepErr)
	}
	if c.json {
		return writeJSON(stdout, map[string]any{"identifiers": a.Identifiers, "problems": a.Problems})
	}
	fmt.Fprintf(stdout, "programmed %d identifiers with %s\n", a.Identifiers, *policyDir)
	for _, p := range a.Problems {
		fmt.Fprintf(stdout, "  not enforced as written: %s\n", p)
	}
	return nil
}
