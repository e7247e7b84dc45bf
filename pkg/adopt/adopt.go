// Package adopt fences the pods a node runs that podfence's ADD never saw:
// pods that predate podfence's install, and pods created while podfence
// was out of the CNI chain (a primary CNI rewrote its conflist). It asks
// the container runtime for its ready pod sandboxes and, for each that has
// no member record, runs the installed podfence plugin's own ADD as the
// runtime would have: the conflist's podfence entry, the sandbox's ID,
// network namespace and pod name, and a prevResult made from the
// addresses the runtime reports. An adopted pod therefore gets exactly the
// record, identifier, lock and programs its ADD would have given it, and
// the runtime's DEL, CHECK and GC, ls, upgrades and the orphan sweep treat
// it like any other.
//
// Races with the runtime are settled under the identifier's lock, which
// the plugin takes. A sandbox whose ADD is in flight is not ready yet and
// is left alone. The runtime's DEL of a sandbox a pass has listed leaves a
// tombstone (package membership) that the pass's ADD, marked as an
// adoption's (cniconf.AdoptionArg), finds under the lock: it adds nothing.
// A DEL that comes after the ADD removes the member as any DEL does. A
// sandbox that stops being ready, or that the runtime no longer knows,
// while it is adopted gets a DEL of the pass's own.
package adopt

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/podfence/podfence/pkg/cniconf"
	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/pinroot"
)

// IfName is the pod's interface the runtime's ADD names (the kubelet's
// pods have eth0).
const IfName = "eth0"

// pluginTimeout bounds one run of the plugin, criTimeout one call to the
// runtime.
const (
	pluginTimeout = time.Minute
	criTimeout    = 10 * time.Second
)

// ErrNotChained is returned when the conflist has no podfence entry: there
// is no configuration to adopt pods with.
var ErrNotChained = errors.New("podfence is not in the CNI chain")

// Options say where adoption finds what it needs.
type Options struct {
	Runtime Runtime
	// Conflist reads the node's conflist (path and contents).
	Conflist func() (string, []byte, error)
	// BinDir is the CNI plugin directory: the plugin run is the one the
	// runtime runs.
	BinDir string
	// Root is the node's pin root, which the conflist's podfence entry
	// must name. With Seed, each adopted pod's live flows are seeded from
	// the kernel's conntrack table into its node-wide maps.
	Root *pinroot.Root
	Seed bool
}

// Report is what one pass found and did.
type Report struct {
	Sandboxes int       // ready, with a network namespace of their own
	Fenced    int       // already members
	Adopted   []Adopted // the pods adopted now
	// Gone are the pods the runtime deleted while the pass adopted them:
	// their DEL ran first (nothing added), or they stopped being ready or
	// known to the runtime once added (taken off again).
	Gone []Gone
	// Deferred are sandboxes left to the next pass: the listing had grown
	// too old to act on (listingMaxAge).
	Deferred int
	Seeded   Seeded  // the adopted pods' live flows, judged as they were opened
	Failed   []error // one per sandbox that could not be adopted
}

// Gone is a pod the runtime deleted while a pass adopted it.
type Gone struct {
	Pod     string // namespace/name
	Sandbox string
	How     string // what the pass saw
}

// listingMaxAge bounds how long a pass acts on one listing of the
// sandboxes: the tombstone of a DEL that ran after the listing must still
// be there when the pass runs the ADD.
const listingMaxAge = membership.TombstoneTTL / 2

// Adopted is a pod a pass fenced.
type Adopted struct {
	Pod     string // namespace/name
	Sandbox string
	// OpenFor is how long the pod ran unfenced: from its sandbox's
	// creation (which its own ADD follows by milliseconds) to the end of
	// its adoption. Zero when the runtime does not say when it was made.
	OpenFor time.Duration
}

// Pass adopts every ready sandbox that is not a member yet.
func Pass(ctx context.Context, o Options) (Report, error) {
	var r Report
	_, data, err := o.Conflist()
	if err != nil {
		return r, err
	}
	conf, err := pluginConf(data)
	if err != nil {
		return r, err
	}
	pinRoot, _ := conf.entry["pinRoot"].(string)
	if pinRoot == "" {
		pinRoot = pinpath.DefaultRoot
	}
	pins := o.Root
	if filepath.Clean(pinRoot) != filepath.Clean(pins.Path()) {
		return r, fmt.Errorf("the conflist's podfence entry pins below %s, this sweeper below %s (--pin-root): adoption would fence pods where this sweeper does not look", pinRoot, pins.Path())
	}
	lctx, cancel := context.WithTimeout(ctx, criTimeout)
	defer cancel()
	sandboxes, err := o.Runtime.Sandboxes(lctx)
	if err != nil && len(sandboxes) == 0 {
		return r, err
	}
	if err != nil {
		r.Failed = append(r.Failed, err) // some could not be read: the others are adopted
	}
	r.Sandboxes = len(sandboxes)
	listed := time.Now()
	var adopted []Sandbox
	for i, sb := range sandboxes {
		if time.Since(listed) > listingMaxAge {
			r.Deferred = len(sandboxes) - i
			break
		}
		_, err := pins.FindContainer(sb.ID, IfName)
		if err == nil {
			r.Fenced++
			continue
		}
		if !errors.Is(err, membership.ErrNotMember) {
			r.Failed = append(r.Failed, err)
			continue
		}
		gone, err := adoptOne(ctx, o, conf, sb)
		if err != nil {
			r.Failed = append(r.Failed, fmt.Errorf("adopt %s/%s (sandbox %s): %w", sb.Namespace, sb.Name, sb.ID, err))
			continue
		}
		if gone != "" {
			r.Gone = append(r.Gone, Gone{Pod: sb.Namespace + "/" + sb.Name, Sandbox: sb.ID, How: gone})
			continue
		}
		a := Adopted{Pod: sb.Namespace + "/" + sb.Name, Sandbox: sb.ID}
		if !sb.Created.IsZero() {
			a.OpenFor = time.Since(sb.Created)
		}
		r.Adopted = append(r.Adopted, a)
		adopted = append(adopted, sb)
	}
	if !o.Seed || len(adopted) == 0 {
		return r, nil
	}
	// Read once every pod of the pass is attached: a flow opened before
	// is in the table, one opened after had its first packet judged.
	flows, err := kernelFlows()
	if err != nil {
		r.Failed = append(r.Failed, fmt.Errorf("read the kernel's conntrack table: no flow of the adopted pods seeded: %w", err))
		return r, nil
	}
	for _, sb := range adopted {
		s, err := seed(pins, sb, flows)
		r.Seeded.Allowed += s.Allowed
		r.Seeded.Denied += s.Denied
		if err != nil {
			r.Failed = append(r.Failed, fmt.Errorf("seed the flows of %s/%s: %w", sb.Namespace, sb.Name, err))
		}
	}
	return r, nil
}

// plugin is podfence's entry with what the runtime adds to it.
type plugin struct {
	name, cniVersion string
	entry            map[string]any
}

func pluginConf(conflist []byte) (plugin, error) {
	entry, err := cniconf.Entry(conflist)
	if err != nil {
		return plugin{}, err
	}
	if entry == nil {
		return plugin{}, ErrNotChained
	}
	var top struct {
		Name       string `json:"name"`
		CNIVersion string `json:"cniVersion"`
	}
	if err := json.Unmarshal(conflist, &top); err != nil {
		return plugin{}, fmt.Errorf("%w: %v", cniconf.ErrMalformed, err)
	}
	return plugin{name: top.Name, cniVersion: top.CNIVersion, entry: entry}, nil
}

// How adoptOne saw a pod the runtime deleted meanwhile.
const (
	goneBeforeAdd = "its DEL ran before the ADD: nothing added"
	goneTornDown  = "torn down before the ADD could fence it: nothing added"
	goneNotReady  = "stopped being ready once added: taken off again"
	goneUnknown   = "the runtime no longer knows it once added: taken off again"
)

// adoptOne runs the plugin's ADD for sb, and its DEL when sb stopped
// being ready, or was removed, meanwhile. gone says how it saw a pod the
// runtime deleted; empty when the pod is adopted.
func adoptOne(ctx context.Context, o Options, p plugin, sb Sandbox) (gone string, err error) {
	if len(sb.IPs) == 0 {
		return "", errors.New("the runtime reports no address for the pod")
	}
	prev := &current.Result{CNIVersion: current.ImplementedSpecVersion,
		Interfaces: []*current.Interface{{Name: IfName, Sandbox: sb.Netns}}}
	for _, a := range sb.IPs {
		bits := a.BitLen()
		prev.IPs = append(prev.IPs, &current.IPConfig{Interface: current.Int(0),
			Address: net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(bits, bits)}})
	}
	conv, err := prev.GetAsVersion(p.cniVersion)
	if err != nil {
		return "", fmt.Errorf("prevResult at CNI version %s: %w", p.cniVersion, err)
	}
	netconf := map[string]any{}
	for k, v := range p.entry {
		netconf[k] = v
	}
	netconf["type"] = cniconf.PluginType
	netconf["name"] = p.name
	netconf["cniVersion"] = p.cniVersion
	netconf["prevResult"] = conv
	stdin, err := json.Marshal(netconf)
	if err != nil {
		return "", err
	}
	bin := filepath.Join(o.BinDir, cniconf.PluginType)
	args := func(cmd string) *invoke.Args {
		return &invoke.Args{Command: cmd, ContainerID: sb.ID, NetNS: sb.Netns, IfName: IfName, Path: o.BinDir,
			PluginArgsStr: strings.Join([]string{"IgnoreUnknown=1", "K8S_POD_NAMESPACE=" + sb.Namespace,
				"K8S_POD_NAME=" + sb.Name, "K8S_POD_INFRA_CONTAINER_ID=" + sb.ID, "K8S_POD_UID=" + sb.UID,
				cniconf.AdoptionArg + "=true"}, ";")}
	}
	// The plugin is not killed halfway when the sweeper stops (it would
	// leave what a killed ADD leaves, which the next ADD repairs, but
	// there is no need): only a hung one is.
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), pluginTimeout)
	defer cancel()
	rctx, rcancel := context.WithTimeout(ctx, criTimeout)
	defer rcancel()
	if _, err := invoke.ExecPluginWithResult(pctx, bin, stdin, args("ADD"), nil); err != nil {
		var cniErr *types.Error
		if errors.As(err, &cniErr) && cniErr.Code == cniconf.ErrCodeDeleted {
			return goneBeforeAdd, nil
		}
		// A pod torn down meanwhile fails the ADD too (its network
		// namespace or veth is gone), which left nothing: no failure.
		if ready, rerr := o.Runtime.Ready(rctx, sb.ID); errors.Is(rerr, ErrUnknownSandbox) || (rerr == nil && !ready) {
			return goneTornDown, nil
		}
		return "", err
	}
	ready, err := o.Runtime.Ready(rctx, sb.ID)
	switch {
	case errors.Is(err, ErrUnknownSandbox):
		gone = goneUnknown
	case err != nil || ready:
		// A runtime that does not answer now is no reason to take a live
		// pod's hooks off: if it was deleted, its DEL, the sweeper's
		// reaction to the veth's removal or the orphan sweep removes
		// the member.
		return "", nil
	default:
		gone = goneNotReady
	}
	// Deleted while it was adopted: take it off again (the runtime's own
	// DEL may have run before the ADD held the identifier's lock, and
	// after its tombstone had been looked for).
	if err := invoke.ExecPluginWithoutResult(pctx, bin, stdin, args("DEL"), nil); err != nil {
		return "", fmt.Errorf("the sandbox %s, and its DEL failed: %w", gone, err)
	}
	return gone, nil
}
