package policy

import (
	"fmt"
	"io"
	"net/netip"
	"strings"
	"time"
)

// clusterKind is the kind the controller writes from ClusterNetworkPolicy
// objects: cluster-scoped, one tier, one priority, rules with actions.
const clusterKind = "ClusterPolicyEndpoint"

// MaxPriority is the largest priority a cluster policy may have
// (ClusterNetworkPolicy's range is 0 to 1000, lower first).
const MaxPriority = 1000

// Tier is a level of cluster-wide policy. Admin rules come before
// NetworkPolicy, Baseline rules after it (see Set.Decide).
type Tier uint8

const (
	TierAdmin Tier = iota
	TierBaseline
)

func (t Tier) String() string {
	switch t {
	case TierAdmin:
		return "Admin"
	case TierBaseline:
		return "Baseline"
	}
	return fmt.Sprintf("tier(%d)", uint8(t))
}

// Action is what a cluster rule does with a connection it matches. The
// values order rules of equal priority, as the upstream node agent orders
// them: Deny, then Accept, then Pass. The controller keeps neither the
// order of a policy's rules nor that of its chunks, so priority and action
// are all there is to order by.
type Action uint8

const (
	ActionDeny   Action = iota // drop the connection
	ActionAccept               // allow it; later tiers are not consulted
	ActionPass                 // skip the rest of this tier
)

func (a Action) String() string {
	switch a {
	case ActionDeny:
		return "Deny"
	case ActionAccept:
		return "Accept"
	case ActionPass:
		return "Pass"
	}
	return fmt.Sprintf("action(%d)", uint8(a))
}

// ClusterRule is one ingress or egress entry of a ClusterPolicyEndpoint,
// with what it needs to be ordered and named once rules of several
// documents are put together.
type ClusterRule struct {
	CIDR   netip.Prefix
	Ports  []PortRange // never empty after parsing: no ports is allPorts
	Action Action
	// Priority is the document's.
	Priority uint16
	// Policy is the document's Policy; Source and Index name the rule in
	// its file ("path#0", spec.egress[Index]).
	Policy string
	Source string
	Index  int
}

// ClusterDocument is one parsed ClusterPolicyEndpoint.
type ClusterDocument struct {
	Source    string // "path#3"
	Name      string
	ChangedAt time.Time
	// Policy names the ClusterNetworkPolicy the document is a chunk of
	// (spec.policyRef.name). The controller packs rules and selected pods
	// into chunks as it does for PolicyEndpoints.
	Policy   string
	Tier     Tier
	Priority uint16
	Selects  []Endpoint
	// Ingress and Egress are the rules in the document's order, which
	// carries no meaning (see Action).
	Ingress, Egress []ClusterRule
	// Notes are what podfence does not enforce as written (see
	// clusterRule): never more open than the document.
	Notes []Note
}

// clusterSpecFields are the fields of a ClusterPolicyEndpoint's spec that
// podfence knows; subject is how the controller chose the pods, which it
// also lists in podSelectorEndpoints, and is accepted without being read.
var (
	clusterSpecFields = []string{"policyRef", "tier", "priority", "subject", "podSelectorEndpoints", "ingress", "egress"}
	clusterRuleFields = []string{"cidr", "ports", "action", "domainName"}
)

// ParseCluster reads every ClusterPolicyEndpoint document of r, YAML or
// JSON, separated by "---". Unlike Parse it has no lenient form: one
// document that does not parse fails the whole input, with an error
// wrapping ErrInvalidDocument that names the document and field.
func ParseCluster(r io.Reader, source string) ([]ClusterDocument, error) {
	data, err := io.ReadAll(r)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", source, err)
	}
	var docs []ClusterDocument
	for i, chunk := range splitDocuments(data) {
		doc, ok, err := parseClusterDocument(chunk, fmt.Sprintf("%s#%d", source, i))
		if err != nil {
			return nil, err
		}
		if ok {
			docs = append(docs, doc)
		}
	}
	return docs, nil
}

func parseClusterDocument(y []byte, src string) (doc ClusterDocument, ok bool, err error) {
	top, ok, err := topObject(y, src)
	if err != nil || !ok {
		return doc, false, err
	}
	m, err := parseHeader(top, clusterKind)
	if err != nil {
		return doc, false, err
	}
	doc.Source, doc.Name, doc.ChangedAt = src, m.Name, m.ChangedAt
	raw, ok := top.raw("spec")
	if !ok {
		return doc, false, invalid(src, "spec", "missing")
	}
	spec, err := newObject(src, "spec", raw)
	if err != nil {
		return doc, false, err
	}
	for _, k := range spec.unknown(clusterSpecFields) {
		doc.Notes = append(doc.Notes, Note{Field: spec.field(k), What: "unknown field, ignored (known: " + strings.Join(clusterSpecFields, ", ") + ")"})
	}
	if err := doc.parseHead(spec); err != nil {
		return doc, false, err
	}
	if doc.Selects, err = parseEndpoints(spec, func(n Note) { doc.Notes = append(doc.Notes, n) }); err != nil {
		return doc, false, err
	}
	if doc.Ingress, err = doc.parseRules(spec, "ingress"); err != nil {
		return doc, false, err
	}
	if doc.Egress, err = doc.parseRules(spec, "egress"); err != nil {
		return doc, false, err
	}
	return doc, true, nil
}

// parseHead reads policyRef, tier and priority, all required: a document
// without them cannot be placed among the others.
func (doc *ClusterDocument) parseHead(spec object) error {
	raw, ok := spec.raw("policyRef")
	if !ok {
		return invalid(doc.Source, "spec.policyRef", "missing")
	}
	ref, err := newObject(doc.Source, "spec.policyRef", raw)
	if err != nil {
		return err
	}
	if doc.Policy, err = ref.str("name", true); err != nil {
		return err
	}
	tier, err := spec.str("tier", true)
	if err != nil {
		return err
	}
	switch tier {
	case "Admin":
		doc.Tier = TierAdmin
	case "Baseline":
		doc.Tier = TierBaseline
	default:
		return invalid(doc.Source, "spec.tier", "%q is not Admin or Baseline", tier)
	}
	if _, ok := spec.raw("priority"); !ok {
		return invalid(doc.Source, "spec.priority", "missing")
	}
	p, _, err := spec.integer("priority", 0, MaxPriority)
	if err != nil {
		return err
	}
	doc.Priority = uint16(p)
	return nil
}

// parseRules parses the rules of spec's key. A rule podfence cannot enforce
// as written (a domainName, which it cannot resolve, or a field it does not
// know) is never made more open than written: an Accept is left out and
// allows nothing; a Deny or a Pass denies on its ports, to every address
// when it names no CIDR. Each such rule is noted.
func (doc *ClusterDocument) parseRules(spec object, key string) ([]ClusterRule, error) {
	list, err := spec.list(key)
	if err != nil {
		return nil, err
	}
	var rules []ClusterRule
	for i, raw := range list {
		o, err := newObject(doc.Source, fmt.Sprintf("spec.%s[%d]", key, i), raw)
		if err != nil {
			return nil, err
		}
		rs, note, err := parseClusterRule(o)
		if err != nil {
			return nil, err
		}
		if note != "" {
			doc.Notes = append(doc.Notes, Note{Field: o.path, Rule: true, What: note})
		}
		for _, r := range rs {
			r.Priority, r.Policy, r.Source, r.Index = doc.Priority, doc.Policy, doc.Source, i
			rules = append(rules, r)
		}
	}
	return rules, nil
}

// parseClusterRule parses one rule into what podfence enforces of it: the
// rule itself, nothing, or denies (one per family for a rule without a
// CIDR); note says what differs from what is written.
func parseClusterRule(o object) (rules []ClusterRule, note string, err error) {
	var r ClusterRule
	action, err := o.str("action", true)
	if err != nil {
		return nil, "", err
	}
	switch action {
	case "Accept":
		r.Action = ActionAccept
	case "Deny":
		r.Action = ActionDeny
	case "Pass":
		r.Action = ActionPass
	default:
		return nil, "", invalid(o.src, o.field("action"), "%q is not Accept, Deny or Pass", action)
	}
	var unknown []string
	for _, k := range o.unknown(clusterRuleFields) {
		unknown = append(unknown, o.field(k))
	}
	ports, unknownPorts, err := parsePorts(o)
	if err != nil {
		return nil, "", err
	}
	r.Ports, unknown = ports, append(unknown, unknownPorts...)
	domain, hasDomain := "", false
	if _, ok := o.raw("domainName"); ok {
		if domain, err = o.str("domainName", true); err != nil {
			return nil, "", err
		}
		hasDomain = true
	}
	_, hasCIDR := o.raw("cidr")
	if hasCIDR {
		s, err := o.str("cidr", true)
		if err != nil {
			return nil, "", err
		}
		if r.CIDR, err = parsePrefix(o.src, o.field("cidr"), s); err != nil {
			return nil, "", err
		}
	} else if !hasDomain {
		return nil, "", invalid(o.src, o.field("cidr"), "missing (a rule needs a cidr or a domainName)")
	}

	var why string
	switch {
	case hasDomain:
		why = fmt.Sprintf("domainName %q is not enforced", domain)
	case len(unknown) > 0:
		why = "unknown field " + strings.Join(unknown, ", ")
	default:
		return []ClusterRule{r}, "", nil
	}
	if r.Action == ActionAccept {
		return nil, why + ": the Accept is left out and allows nothing", nil
	}
	was := r.Action
	r.Action = ActionDeny
	if hasDomain {
		// The addresses the name stands for are unknown: all of them.
		v4, v6 := r, r
		v4.CIDR, v6.CIDR = netip.MustParsePrefix("0.0.0.0/0"), netip.MustParsePrefix("::/0")
		return []ClusterRule{v4, v6}, fmt.Sprintf("%s: the %s denies its ports to every address", why, was), nil
	}
	return []ClusterRule{r}, fmt.Sprintf("%s: the %s denies its cidr and ports", why, was), nil
}
