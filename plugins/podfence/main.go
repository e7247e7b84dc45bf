// Command podfence is the CNI plugin: chained after the primary plugin, it
// attaches the pod identifier's eBPF programs to the pod's host veth before
// the pod sends its first packet, and records the pod as a member of the
// identifier so that only the last replica's DEL removes the shared pins.
package main

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/cilium/ebpf"
	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/attach"
	"github.com/podfence/podfence/pkg/cniconf"
	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/pinroot"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/pkg/policy"
)

// podfence's own CNI error codes (the spec reserves 100 and up for plugins).
const (
	errPolicy   uint = 101 // the policy directory holds an invalid document
	errDatapath uint = 102 // loading, pinning or programming the eBPF objects failed
	errAttach   uint = 103 // attaching to or detaching from the veth failed
	errState    uint = 104 // the membership store could not be read or written
)

func main() {
	skel.PluginMainFuncs(skel.CNIFuncs{
		Add:    cmdAdd,
		Del:    cmdDel,
		Check:  cmdCheck,
		GC:     cmdGC,
		Status: cmdStatus,
	}, version.PluginSupports("0.4.0", "1.0.0", "1.1.0"), "podfence: Kubernetes NetworkPolicy in eBPF")
}

func cmdAdd(args *skel.CmdArgs) (err error) {
	conf, err := parseConfig(args.StdinData, true)
	if err != nil {
		return err
	}
	call := startCall(conf, "ADD", args)
	defer func() { call.finish(err) }()

	id, k8s, err := identify(args)
	if err != nil {
		return err
	}
	call.id = id
	if args.Netns == "" {
		return types.NewError(types.ErrInvalidEnvironmentVariables, "CNI_NETNS is empty: ADD needs the pod's network namespace", "")
	}
	prev, err := current.NewResultFromResult(conf.PrevResult)
	if err != nil {
		return configError("prevResult: %v", err)
	}
	veth, err := findHostVeth(prev, args.Netns, args.IfName)
	if err != nil {
		return err
	}
	call.veth = veth.Name
	if err := checkSources(conf, prev); err != nil {
		return err
	}
	call.mark("find-veth")
	root, err := pinroot.Open(conf.PinRoot, pinroot.Options{Create: true,
		Global: bpf.GlobalOptions{CTv4Entries: conf.CTv4Entries, CTv6Entries: conf.CTv6Entries}})
	if err != nil {
		return types.NewError(errDatapath, err.Error(), "")
	}
	defer root.Close()
	probe := root.TCXProbe()
	mode, saveProbe, err := probe.Resolve(conf.attachMode)
	if err != nil {
		return types.NewError(errAttach, err.Error(), "")
	}
	// A policy directory that cannot be read, or a policy the datapath
	// cannot hold, fails the ADD before anything changes in bpffs. (A
	// document that does not parse only affects the pods it selects, as
	// policy.ReadDir says; the log names it.)
	if set, err := readPolicy(conf, id); err != nil {
		return err
	} else if err := set.Check(); err != nil {
		return policyError(conf, err)
	}
	call.mark("check-policy")

	lock, err := root.LockOrCreate(id)
	if err != nil {
		return types.NewError(errState, err.Error(), "")
	}
	defer lock.Unlock()
	call.mark("lock")
	if err := settleTombstone(lock, membership.Key(args.ContainerID, args.IfName), k8s.adoption); err != nil {
		if _, cerr := lock.RemoveIfUnused(); cerr != nil {
			err = errors.Join(err, cerr)
		}
		return err
	}
	// Read again under the lock: ADDs of one identifier apply the policy in
	// the order they hold it, so an older reading never overwrites a newer.
	set, err := readPolicy(conf, id)
	if err != nil {
		if _, cerr := lock.RemoveIfUnused(); cerr != nil {
			err = errors.Join(err, cerr)
		}
		return err
	}
	call.policy = set.Problems
	call.mark("read-policy")

	member := membership.Member{
		ContainerID: args.ContainerID,
		IfName:      args.IfName,
		HostVeth:    veth.Name,
		HostIfindex: veth.Index,
		IPs:         podIPs(prev),
		AttachMode:  string(mode),
		AnySource:   !conf.sourceCheck(),
	}
	added, err := lock.Add(member, pinroot.AddOptions{Policy: set, Mark: call.mark})
	if up := added.Upgraded; up.Changed() {
		call.renewed = fmt.Sprintf("from layout %d, maps %v, programs %v, %d members moved", up.Renewal.From, up.Renewal.Maps, up.Renewal.Programs, up.Moved)
		if up.Unmoved != nil {
			call.renewed += fmt.Sprintf(" (not moved: %v)", up.Unmoved)
		}
	}
	if added.Replaced != nil {
		call.replaced = added.Replaced.Error()
	}
	if isCapacityError(err) {
		return policyError(conf, err) // the policy changed since it was checked
	}
	if err != nil {
		return cniError(err, errDatapath)
	}
	call.action = fmt.Sprintf("attached (%s), policy selected=%v ingress-isolated=%v egress-isolated=%v",
		mode, set.Selected, set.Ingress.Isolated, set.Egress.Isolated)
	if saveProbe {
		if err := probe.Save(); err != nil {
			call.action += fmt.Sprintf("; the tcx probe's answer is not recorded: %v", err)
		}
	}
	return types.PrintResult(conf.PrevResult, conf.CNIVersion)
}

// settleTombstone, under the identifier's lock, refuses an adoption's ADD
// of a container whose DEL has run, and clears the tombstone of one the
// runtime adds itself (see package membership).
func settleTombstone(lock *pinroot.Hold, key string, adoption bool) error {
	if !adoption {
		if err := lock.RemoveTombstone(key); err != nil {
			return types.NewError(errState, err.Error(), "")
		}
		return nil
	}
	deleted, err := lock.HasTombstone(key)
	if err != nil {
		return types.NewError(errState, err.Error(), "")
	}
	if deleted {
		return types.NewError(cniconf.ErrCodeDeleted, fmt.Sprintf("not adopted: the runtime's DEL of %s ran already (the pod is being deleted)", key), "")
	}
	return nil
}

// checkSources refuses, before anything changes, a prevResult whose
// addresses the source check cannot hold or would leave the pod silent.
func checkSources(conf *PluginConf, prev *current.Result) error {
	n := len(membership.Member{IPs: podIPs(prev)}.Sources())
	switch {
	case n > bpf.MaxSourceAddrs:
		return configError("prevResult lists %d addresses for the pod; podfence holds at most %d per pod", n, bpf.MaxSourceAddrs)
	case n == 0 && conf.sourceCheck():
		return configError("prevResult lists no address for the pod: the source check would drop every flow it opens (the primary plugin must report the pod's addresses, or set sourceCheck false)")
	}
	return nil
}

// readPolicy is what policyDir says for id. ADD checks it with Set.Check
// before it changes anything; ApplyPolicy compiles it again when it writes.
func readPolicy(conf *PluginConf, id podid.ID) (policy.Set, error) {
	dir, err := policy.ReadDir(conf.PolicyDir)
	if err != nil {
		return policy.Set{}, policyError(conf, err)
	}
	docs, cluster := dir.Documents(), dir.ClusterDocuments()
	// After a restart the sweeper's mirror has not confirmed these files
	// with the API yet: a strict pod opens nothing on their word (the
	// sweeper programs it at the first sync); a standard pod gets the last
	// policy known, which is closer to the truth than none, so only strict
	// ADDs pay for the look.
	if conf.mode == policy.ModeStrict {
		synced, err := policy.Synced(conf.PolicyDir)
		if err != nil {
			return policy.Set{}, policyError(conf, err)
		}
		if !synced {
			docs, cluster = nil, nil
		}
	}
	return policy.ForIdentifier(docs, id, conf.mode).WithCluster(cluster, id), nil
}

// isCapacityError tells a policy the datapath cannot hold.
func isCapacityError(err error) bool {
	return errors.Is(err, policy.ErrTooManyPortRanges) || errors.Is(err, policy.ErrTooManyEntries) ||
		errors.Is(err, policy.ErrTooManyPortSets) || errors.Is(err, policy.ErrTooManyTierRules)
}

// policyError is a document that cannot be read, or a policy the datapath
// cannot hold (101).
func policyError(conf *PluginConf, err error) error {
	return types.NewError(errPolicy, fmt.Sprintf("policy directory %s: %v", conf.PolicyDir, err), "")
}

func cmdDel(args *skel.CmdArgs) (err error) {
	conf, err := parseConfig(args.StdinData, false)
	if err != nil {
		return err
	}
	call := startCall(conf, "DEL", args)
	defer func() { call.finish(err) }()

	pins := pinroot.At(conf.PinRoot)
	key := membership.Key(args.ContainerID, args.IfName)
	// Before the lock: an adoption's ADD that lists the pod before this
	// DEL and adds it after then finds the tombstone (package membership).
	if err := pins.PutTombstone(key, time.Now()); err != nil {
		return types.NewError(errState, err.Error(), "")
	}
	// DEL comes in shapes ADD never sees (no netns, no prevResult, after a
	// failed ADD, twice): it works from the record alone, and finds the
	// identifier by search when the arguments do not name it.
	id, _, idErr := identify(args)
	lock, err := pins.Lock(id)
	if idErr != nil || errors.Is(err, membership.ErrNoIdentifier) {
		found, ferr := pins.FindContainer(args.ContainerID, args.IfName)
		if errors.Is(ferr, membership.ErrNotMember) {
			call.action = "nothing recorded"
			return nil
		}
		if ferr != nil {
			// EACCES, EIO: the record may be there, with attachments.
			return types.NewError(errState, ferr.Error(), "")
		}
		id = found
		lock, err = pins.Lock(id)
	}
	if errors.Is(err, membership.ErrNoIdentifier) {
		call.action = "nothing recorded"
		return nil
	}
	if err != nil {
		return types.NewError(errState, err.Error(), "")
	}
	defer lock.Unlock()
	call.id = id
	call.mark("lock")

	m, err := lock.Member(key)
	switch {
	case err == nil:
		call.veth = m.HostVeth
		if err := lock.RemoveMember(m); err != nil {
			return cniError(err, errState)
		}
		call.mark("detach")
		call.action = "detached"
	case errors.Is(err, membership.ErrNotMember):
		// An ADD killed before the record was in place may have left
		// the member's directory (empty, or with the record's temporary):
		// nothing was attached for it, and nobody else removes it while
		// other members keep the identifier.
		if err := lock.Remove(key); err != nil {
			return types.NewError(errState, err.Error(), "")
		}
		call.action = "not a member"
	case errors.Is(err, membership.ErrCorruptRecord):
		// The record is ours and unreadable: what it attached cannot be
		// found, but its link pins go with its directory.
		if err := lock.Remove(key); err != nil {
			return types.NewError(errState, err.Error(), "")
		}
		call.action = "removed a corrupt record"
	default:
		return types.NewError(errState, err.Error(), "")
	}
	if _, err := lock.RemoveIfUnused(); err != nil {
		return cniError(err, errState)
	}
	call.mark("remove-unused")
	return nil
}

func cmdCheck(args *skel.CmdArgs) (err error) {
	conf, err := parseConfig(args.StdinData, true)
	if err != nil {
		return err
	}
	call := startCall(conf, "CHECK", args)
	defer func() { call.finish(err) }()

	id, _, err := identify(args)
	if err != nil {
		return err
	}
	call.id = id
	lock, err := pinroot.At(conf.PinRoot).Lock(id)
	if err != nil {
		return types.NewError(errState, fmt.Sprintf("container %s: %v", args.ContainerID, err), "")
	}
	defer lock.Unlock()
	m, err := lock.Member(membership.Key(args.ContainerID, args.IfName))
	if err != nil {
		return types.NewError(errState, err.Error(), "")
	}
	call.veth = m.HostVeth
	ingress, egress, err := lock.ProgramIDs()
	if err != nil {
		return types.NewError(errDatapath, err.Error(), "")
	}
	if present, err := pinroot.VethPresent(m); err != nil {
		return types.NewError(errAttach, err.Error(), "")
	} else if !present {
		return types.NewError(errAttach, fmt.Sprintf("veth %s (ifindex %d) of container %s is gone", m.HostVeth, m.HostIfindex, m.ContainerID), "")
	}
	for _, c := range []struct {
		hook attach.Hook
		want ebpf.ProgramID
		what string
	}{{attach.HookEgress, ingress, "ingress"}, {attach.HookIngress, egress, "egress"}} {
		ids, err := attach.Attached(m.HostIfindex, c.hook)
		if err != nil {
			return types.NewError(errAttach, err.Error(), "")
		}
		if !slices.Contains(ids, c.want) {
			return types.NewError(errAttach, fmt.Sprintf("veth %s lacks the %s program of %s (id %d) on its %s hook", m.HostVeth, c.what, id, c.want, c.hook), "")
		}
	}
	want := bpf.Sources{Addrs: m.Sources(), Any: m.AnySource}
	got, ok, err := lock.Sources(m.HostIfindex)
	if err != nil {
		return types.NewError(errDatapath, err.Error(), "")
	}
	if !ok || !got.Equal(want) {
		return types.NewError(errDatapath, fmt.Sprintf("veth %s: the pod may send from %+v, its record says %+v (a later ADD or upgrade writes it)", m.HostVeth, got, want), "")
	}
	call.action = "both programs attached, sources recorded"
	return nil
}

func cmdGC(args *skel.CmdArgs) (err error) {
	conf, err := parseConfig(args.StdinData, false)
	if err != nil {
		return err
	}
	call := startCall(conf, "GC", args)
	defer func() { call.finish(err) }()

	valid := map[string]bool{}
	for _, a := range conf.ValidAttachments {
		valid[membership.Key(a.ContainerID, a.IfName)] = true
	}
	n := pinroot.At(conf.PinRoot)
	ids, err := n.Identifiers()
	if err != nil {
		return types.NewError(errState, err.Error(), "")
	}
	// Every member the runtime does not list goes, whether or not its
	// record can be read: the runtime knows all of its containers.
	stale := func(key string, _ *membership.Member, _ bool) bool { return !valid[key] }
	removed, emptied := 0, 0
	var errs []error
	for _, id := range ids {
		c, err := n.Collect(id, stale)
		removed += len(c.Members) + len(c.Keys)
		if c.Identifier {
			emptied++
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	call.action = fmt.Sprintf("removed %d stale members, %d unused identifiers", removed, emptied)
	if len(errs) > 0 {
		return cniError(errors.Join(errs...), errState)
	}
	return nil
}

// cniError gives err the CNI code of the part of the node it concerns
// (package pinroot's sentinels), or fallback.
func cniError(err error, fallback uint) error {
	code := fallback
	switch {
	case errors.Is(err, pinroot.ErrAttach):
		code = errAttach
	case errors.Is(err, pinroot.ErrDatapath):
		code = errDatapath
	case errors.Is(err, pinroot.ErrState):
		code = errState
	}
	return types.NewError(code, err.Error(), "")
}

func cmdStatus(args *skel.CmdArgs) (err error) {
	conf, err := parseConfig(args.StdinData, false)
	if err != nil {
		return err
	}
	call := startCall(conf, "STATUS", args)
	defer func() { call.finish(err) }()
	root, err := pinroot.Open(conf.PinRoot, pinroot.Options{Create: true})
	if err != nil {
		return types.NewError(types.ErrPluginNotAvailable, err.Error(), "")
	}
	cached, err := root.VerifyDatapath()
	if err != nil {
		return types.NewError(types.ErrPluginNotAvailable, err.Error(), "")
	}
	call.action = "ready (datapath verified on this kernel; " + bpf.ServiceJudgement() + ")"
	if cached {
		call.action = "ready (datapath verified earlier on this kernel; " + bpf.ServiceJudgement() + ")"
	}
	return nil
}

// identify derives the pod identifier from K8S_POD_NAME and
// K8S_POD_NAMESPACE, or from the container ID when the runtime passes no
// Kubernetes arguments, and returns the arguments it read. Invalid names
// are CNI error 4.
func identify(args *skel.CmdArgs) (podid.ID, k8sArgs, error) {
	k8s, err := parseK8sArgs(args.Args)
	if err != nil {
		return "", k8s, types.NewError(types.ErrInvalidEnvironmentVariables, err.Error(), "")
	}
	var id podid.ID
	if k8s.name != "" || k8s.namespace != "" {
		id, err = podid.FromPod(k8s.name, k8s.namespace)
	} else {
		id, err = podid.FromContainerID(args.ContainerID)
	}
	if err != nil {
		return "", k8s, types.NewError(types.ErrInvalidEnvironmentVariables, err.Error(), "")
	}
	return id, k8s, nil
}
