package policy

import (
	"fmt"
	"strconv"

	"github.com/podfence/podfence/pkg/podid"
)

// Mode is what happens to a pod no document selects.
type Mode string

const (
	ModeStandard Mode = "standard" // allowed
	ModeStrict   Mode = "strict"   // denied until a document selects it
)

// ParseMode parses the plugin's enforcingMode. Empty means the default,
// standard.
func ParseMode(s string) (Mode, error) {
	switch Mode(s) {
	case "", ModeStandard:
		return ModeStandard, nil
	case ModeStrict:
		return ModeStrict, nil
	}
	return "", fmt.Errorf("enforcing mode %q: must be %s or %s", s, ModeStandard, ModeStrict)
}

// Direction is a direction of traffic as seen from the pod.
type Direction uint8

const (
	Ingress Direction = 0
	Egress  Direction = 1
)

func (d Direction) String() string {
	switch d {
	case Ingress:
		return "ingress"
	case Egress:
		return "egress"
	}
	return "direction(" + strconv.Itoa(int(d)) + ")"
}

// DirectionPolicy is the policy of one direction of one identifier.
type DirectionPolicy struct {
	Isolated bool // false: everything is allowed and Rules do not matter
	Rules    []Rule
}

// Set is what the datapath enforces for one identifier.
type Set struct {
	Mode            Mode
	Selected        bool     // some document selects the identifier
	Sources         []string // the selecting documents ("file#index"), for messages
	Ingress, Egress DirectionPolicy
	// Problems are what the selecting documents say that is not enforced
	// as written (Document.Report), for logs.
	Problems []string
	// Cluster is what ClusterPolicyEndpoints say about the identifier: the
	// tiers around the PolicyEndpoints' rules (see Decide).
	Cluster Cluster
}

// Check compiles both directions as the datapath will, so that a policy it
// cannot hold (ErrTooManyPortRanges, ErrTooManyEntries, ErrTooManyPortSets)
// is refused before anything changes. The error names the documents the set
// comes from.
func (s *Set) Check() error {
	lists := map[string]bool{}
	for _, d := range []Direction{Ingress, Egress} {
		v4, v6, err := s.Direction(d).Compile()
		if err != nil {
			return fmt.Errorf("%s rules of %v: %w", d, s.Sources, err)
		}
		for _, entries := range [][]Entry{v4, v6} {
			if len(entries) > MaxEntries {
				return fmt.Errorf("%s rules of %v: %d prefixes for one address family, at most %d: %w",
					d, s.Sources, len(entries), MaxEntries, ErrTooManyEntries)
			}
		}
		for _, e := range append(v4, v6...) {
			if len(e.Ports) > InlinePortRanges {
				lists[fmt.Sprint(e.Ports)] = true
			}
		}
	}
	tierEntries := 0
	for _, tier := range []*[2]TierRules{&s.Cluster.Admin, &s.Cluster.Baseline} {
		for d, rules := range tier {
			v4, v6, err := rules.Compile()
			if err != nil {
				return fmt.Errorf("%s cluster rules of %v: %w", Direction(d), s.Cluster.Sources, err)
			}
			tierEntries += len(v4) + len(v6)
			for _, e := range append(v4, v6...) {
				for _, slot := range e.Slots {
					if len(slot.Ports) > 1 {
						lists[fmt.Sprint(slot.Ports)] = true
					}
				}
			}
		}
	}
	if tierEntries > MaxTierEntries {
		return fmt.Errorf("cluster rules of %v: %d prefixes, at most %d: %w",
			s.Cluster.Sources, tierEntries, MaxTierEntries, ErrTooManyEntries)
	}
	if len(lists) > MaxPortSets {
		return fmt.Errorf("rules of %v: %d distinct lists of more than %d port ranges, at most %d: %w",
			s.Sources, len(lists), InlinePortRanges, MaxPortSets, ErrTooManyPortSets)
	}
	return nil
}

// Direction returns the policy of d. It panics on a Direction other than
// Ingress and Egress, which is a programming error.
func (s *Set) Direction(d Direction) *DirectionPolicy {
	switch d {
	case Ingress:
		return &s.Ingress
	case Egress:
		return &s.Egress
	}
	panic("policy: invalid " + d.String())
}

// ForIdentifier computes the Set of id: the documents with a
// podSelectorEndpoints entry whose pod maps to id are selected (entries whose
// pod name is not a valid Kubernetes name select nothing; they cannot belong
// to a running pod), and with them every other chunk of their policy
// (Document.Policy): the controller may put a policy's rules in chunks that
// name no pod. A direction is isolated if any selected document lists it in
// podIsolation, and its rules are the rules of that direction of the
// selected documents that isolate it, concatenated. A document's rules for a
// direction it does not isolate count for nothing, as in Kubernetes, where a
// NetworkPolicy's egress rules are ignored unless its policyTypes include
// Egress: otherwise they would widen what another document isolates (the
// network policy controller never writes such rules).
//
// With no selecting document, ModeStrict isolates both directions with no
// rules (deny all); any other mode isolates nothing (allow all). The rules
// share memory with docs.
func ForIdentifier(docs []Document, id podid.ID, mode Mode) Set {
	s := Set{Mode: mode}
	for _, d := range Selecting(docs, id) {
		s.Selected = true
		s.Sources = append(s.Sources, d.Source)
		s.Problems = append(s.Problems, d.Report()...)
		s.Ingress.Isolated = s.Ingress.Isolated || d.IsolateIngress
		s.Egress.Isolated = s.Egress.Isolated || d.IsolateEgress
		if d.IsolateIngress {
			s.Ingress.Rules = append(s.Ingress.Rules, d.Ingress...)
		}
		if d.IsolateEgress {
			s.Egress.Rules = append(s.Egress.Rules, d.Egress...)
		}
	}
	if !s.Selected && mode == ModeStrict {
		s.Ingress.Isolated, s.Egress.Isolated = true, true
	}
	return s
}

// Selecting are the documents that apply to id, in order: those that
// select it, and every chunk of the same policy.
func Selecting(docs []Document, id podid.ID) []Document {
	policies := map[string]bool{}
	for _, d := range docs {
		if d.Policy != "" && selects(d, id) {
			policies[d.Policy] = true
		}
	}
	var out []Document
	for _, d := range docs {
		if policies[d.Policy] || d.Policy == "" && selects(d, id) {
			out = append(out, d)
		}
	}
	return out
}

func selects(d Document, id podid.ID) bool { return selectsAny(d.Selects, id) }

// selectsAny reports whether a pod of eps maps to id. An entry whose pod
// name is not a valid Kubernetes name selects nothing: it cannot belong to
// a running pod.
func selectsAny(eps []Endpoint, id podid.ID) bool {
	for _, e := range eps {
		if got, err := podid.FromPod(e.Name, e.Namespace); err == nil && got == id {
			return true
		}
	}
	return false
}
