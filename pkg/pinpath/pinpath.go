// Package pinpath is where podfence keeps its objects in bpffs: the one
// place that names the directories and pins below a pin root. The plugin
// writes this layout, the sweeper reads and cleans it, and the tests check
// it, so all three spell it through this package:
//
//	<root>/global/<map>                           maps shared by every identifier on the node
//	<root>/global/layout, <root>/ids/<id>/layout  the layout version (and build) of the maps there
//	<root>/global/slots/<n>                       slot n's owner (a symlink to its identifier's directory)
//	<root>/global/uplinks/if<ifindex>             the uplinks' judge of Service flows (TCX link pins)
//	<root>/ids/<identifier>/prog_ingress|egress   the identifier's programs
//	<root>/ids/<identifier>/prog_after_nat        its judge of Service flows, where the kernel has one
//	<root>/ids/<identifier>/<map>                 its state, counters, policy tries, port sets, members' sources
//	<root>/ids/<identifier>/members/<key>/record  a member's record (a symlink, see package membership)
//	<root>/ids/<identifier>/members/<key>/link_*  the member's pinned TCX links
//	<root>/status/verified-<hash>                 STATUS's cache: this build loads on this kernel
//	<root>/deleted/<key>                          a DEL's tombstone of a member key (see package membership)
//
// bpffs refuses names with a '.', so every name here, and every identifier
// and member key placed in a path, has none.
package pinpath

import (
	"path/filepath"

	"github.com/podfence/podfence/pkg/pinfs"
	"github.com/podfence/podfence/pkg/podid"
)

// DefaultRoot is the pin root of the plugin's pinRoot and the sweeper's
// --pin-root when they are not set.
const DefaultRoot = "/sys/fs/bpf/podfence"

// Directory and pin names below a pin root.
const (
	GlobalDir      = "global"
	IdentifiersDir = "ids"
	MembersDir     = "members"
	// StatusDir holds one empty directory per datapath build and kernel
	// that STATUS has verified (bpffs holds no regular files).
	StatusDir = "status"
	// TombstonesDir holds one record per container interface a DEL saw
	// (package membership): an adoption's ADD that raced the DEL finds it
	// and adds nothing.
	TombstonesDir = "deleted"
	// Layout is a symlink in the global directory and in each
	// identifier's whose target records the layout version of the maps
	// there and, in an identifier's, the datapath object whose programs
	// are pinned (package bpf reads and writes it).
	Layout = "layout"
	// TCXProbe is a record in StatusDir of whether the kernel attaches TCX
	// links (package attach), probed once per boot.
	TCXProbe = "tcx"
	// PolicyError is a symlink whose target records why the policy
	// directory was last refused, and since when; absent while it is valid.
	PolicyError = "policy-error"
	// PolicyErrorTemp is the name the record is written under before the
	// rename that makes it visible; PolicyErrorTempV2 the one builds
	// before it used, which a writer killed halfway may have left.
	PolicyErrorTemp   = PolicyError + pinfs.TempSuffix
	PolicyErrorTempV2 = PolicyError + "-new"

	ProgIngress = "prog_ingress"
	ProgEgress  = "prog_egress"
	// ProgAfterNAT is an identifier's judge of its pods' Service flows
	// after the translation, installed in MapJudges at its slot.
	ProgAfterNAT = "prog_after_nat"
	// ProgLocal is its judge of those delivered to a socket of the node,
	// installed in MapLocalJudges at the same slot.
	ProgLocal = "prog_local"
	// SlotsDir, in GlobalDir, holds one symlink per identifier slot (the
	// index of its programs in MapJudges and the mark its veths stamp),
	// naming the identifier's directory: creating it reserves the slot.
	SlotsDir = "slots"
	// UplinksDir, in GlobalDir, holds the TCX link pins of the judge of
	// translated Service flows on the node's uplinks (package uplink),
	// one per interface, "if<ifindex>".
	UplinksDir = "uplinks"
	// LocalLink, in GlobalDir, is the link pin of the judge of Service
	// flows delivered to the node's own sockets, at the ingress of the
	// cgroup the sweeper hooks (package localhook).
	LocalLink = "link_local"

	// Record is a member's record; RecordTemp the name it is written under
	// before the rename that makes it visible.
	Record     = "record"
	RecordTemp = Record + pinfs.TempSuffix

	// LinkIngress and LinkEgress are a member's TCX links on the host
	// veth's ingress and egress hooks.
	LinkIngress = "link_ingress"
	LinkEgress  = "link_egress"
)

// Map pin names: the maps' names in the object file, which the loader checks.
const (
	MapCTv4        = "ct_v4"
	MapCTv6        = "ct_v6"
	MapNodeAddrs   = "node_addrs"
	MapDenyEvents  = "deny_events"
	MapEventBudget = "event_budget"
	MapFrags       = "frags"
	MapTickClock   = "tick_clock"
	MapServices    = "services"
	MapJudges      = "judges"
	MapLocalJudges = "local_judges"

	MapState    = "state"
	MapCounters = "counters"
	MapPortSets = "port_sets"
	MapPolInV4  = "pol_in_v4"
	MapPolInV6  = "pol_in_v6"
	MapPolEgV4  = "pol_eg_v4"
	MapPolEgV6  = "pol_eg_v6"
	MapSources  = "sources"
	MapTiers    = "tiers"

	// Side 1 of the policy (the maps above are side 0): a change is
	// written to the side not in force, then made current at once.
	MapPolInV4Side1 = "pol_in_v4_1"
	MapPolInV6Side1 = "pol_in_v6_1"
	MapPolEgV4Side1 = "pol_eg_v4_1"
	MapPolEgV6Side1 = "pol_eg_v6_1"
	MapTiersSide1   = "tiers_1"
)

// GlobalMaps are the map pins in GlobalDir.
func GlobalMaps() []string {
	return []string{MapCTv4, MapCTv6, MapNodeAddrs, MapDenyEvents, MapEventBudget, MapFrags, MapTickClock, MapServices, MapJudges, MapLocalJudges}
}

// IdentifierMaps are the map pins of an identifier's directory, beside its
// two program pins and MembersDir.
func IdentifierMaps() []string {
	return []string{MapState, MapCounters, MapPortSets, MapPolInV4, MapPolInV6, MapPolEgV4, MapPolEgV6, MapSources, MapTiers,
		MapPolInV4Side1, MapPolInV6Side1, MapPolEgV4Side1, MapPolEgV6Side1, MapTiersSide1}
}

// Root is a pin root: a directory on bpffs that podfence owns.
type Root string

// Global is the directory of the node-wide maps.
func (r Root) Global() string { return filepath.Join(string(r), GlobalDir) }

// Uplinks is the directory of the uplink hooks' link pins.
func (r Root) Uplinks() string { return filepath.Join(string(r), GlobalDir, UplinksDir) }

// LocalLink is the pin of the link that hooks the local judge to a cgroup.
func (r Root) LocalLink() string { return filepath.Join(string(r), GlobalDir, LocalLink) }

// Slots is the directory of the identifiers' slot reservations.
func (r Root) Slots() string { return filepath.Join(string(r), GlobalDir, SlotsDir) }

// Status is the directory of STATUS's verified markers.
func (r Root) Status() string { return filepath.Join(string(r), StatusDir) }

// TCXProbe is the record of the TCX probe's answer.
func (r Root) TCXProbe() string { return filepath.Join(string(r), StatusDir, TCXProbe) }

// Tombstones is the directory of the DELs' tombstones.
func (r Root) Tombstones() string { return filepath.Join(string(r), TombstonesDir) }

// PolicyError is the record of an invalid policy directory.
func (r Root) PolicyError() string { return filepath.Join(string(r), PolicyError) }

// Identifiers is the directory of every identifier's directory.
func (r Root) Identifiers() string { return filepath.Join(string(r), IdentifiersDir) }

// Identifier is the directory of one identifier's pins, which is also its
// lock (see package membership).
func (r Root) Identifier(id podid.ID) string {
	return filepath.Join(string(r), IdentifiersDir, string(id))
}

// Members is the directory of an identifier's member directories.
func (r Root) Members(id podid.ID) string {
	return filepath.Join(r.Identifier(id), MembersDir)
}

// Member is the directory of one member (its record and link pins).
func (r Root) Member(id podid.ID, key string) string {
	return filepath.Join(r.Members(id), key)
}

// Record is a member's record.
func (r Root) Record(id podid.ID, key string) string {
	return filepath.Join(r.Member(id, key), Record)
}
