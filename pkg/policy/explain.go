package policy

import (
	"net/netip"
	"slices"

	"github.com/podfence/podfence/pkg/podid"
)

// RuleRef is one rule of one document, as a person finds it in the file.
type RuleRef struct {
	Source    string       `json:"source"` // "path#index"
	Name      string       `json:"name"`
	Namespace string       `json:"namespace"`
	Rule      int          `json:"rule"` // index in the document's ingress or egress list
	CIDR      netip.Prefix `json:"cidr"`
	// Except is the except entry that excludes the address, if any.
	Except *netip.Prefix `json:"except,omitempty"`
	// Ports is the range that holds the port, if any.
	Ports *PortRange `json:"ports,omitempty"`
}

// Explanation says which rules decide a connection of an identifier in one
// direction, by the same semantics as DirectionPolicy.Allows.
type Explanation struct {
	Isolated  bool     `json:"isolated"`
	Documents []string `json:"documents"` // the selecting documents
	// Allowing are the rules that allow the connection (any one is
	// enough); empty when it is denied.
	Allowing []RuleRef `json:"allowing"`
	// Near are, for a denied connection, the rules whose CIDR holds the
	// address but an except excludes it, or whose ports do not include the
	// connection's.
	Near []RuleRef `json:"near"`
	// NotAsWritten is what the selecting documents say that podfence
	// does not enforce as written (Document.Report): a rule left out
	// allows nothing, a broken document enforces its fallback.
	NotAsWritten []string `json:"not_enforced_as_written,omitempty"`
}

// Explain evaluates a connection of id with remote address addr, protocol
// proto and destination port port in direction d against docs, rule by
// rule, keeping where each rule came from.
func Explain(docs []Document, id podid.ID, mode Mode, d Direction, addr netip.Addr, proto uint8, port uint16) Explanation {
	set := ForIdentifier(docs, id, mode)
	e := Explanation{Isolated: set.Direction(d).Isolated, Documents: append([]string{}, set.Sources...),
		Allowing: []RuleRef{}, Near: []RuleRef{}, NotAsWritten: set.Problems}
	addr = addr.Unmap().WithZone("")
	for _, doc := range Selecting(docs, id) {
		isolates, rules := doc.IsolateIngress, doc.Ingress
		if d == Egress {
			isolates, rules = doc.IsolateEgress, doc.Egress
		}
		if !isolates {
			continue
		}
		for i, r := range rules {
			if !r.CIDR.Contains(addr) {
				continue
			}
			ref := RuleRef{Source: doc.Source, Name: doc.Name, Namespace: doc.Namespace, Rule: i, CIDR: r.CIDR}
			if j := slices.IndexFunc(r.Except, func(p netip.Prefix) bool { return p.Contains(addr) }); j >= 0 {
				ref.Except = &r.Except[j]
				e.Near = append(e.Near, ref)
				continue
			}
			if j := slices.IndexFunc(r.Ports, func(p PortRange) bool { return p.Contains(proto, port) }); j >= 0 {
				ref.Ports = &r.Ports[j]
				e.Allowing = append(e.Allowing, ref)
				continue
			}
			e.Near = append(e.Near, ref)
		}
	}
	return e
}
