package policy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"sigs.k8s.io/yaml"
)

const (
	apiVersion = "networking.k8s.aws/v1alpha1"
	kind       = "PolicyEndpoint"
)

// Protocol numbers as in the IP header. ProtocolAny matches every protocol
// (a rule without ports).
type Protocol uint8

const (
	ProtocolAny  Protocol = 0
	ProtocolTCP  Protocol = 6
	ProtocolUDP  Protocol = 17
	ProtocolSCTP Protocol = 132
)

func (p Protocol) String() string {
	switch p {
	case ProtocolAny:
		return "any"
	case ProtocolTCP:
		return "TCP"
	case ProtocolUDP:
		return "UDP"
	case ProtocolSCTP:
		return "SCTP"
	}
	return "proto" + strconv.Itoa(int(p))
}

// PortRange allows ports First..Last (inclusive) of Protocol. A protocol-only
// rule is {P, 0, 65535}; "all ports and protocols" is {ProtocolAny, 0, 65535}.
type PortRange struct {
	Protocol    Protocol
	First, Last uint16
}

// Contains reports whether the range allows port of the IP protocol proto.
// ProtocolAny matches any proto, including those without ports (ICMP).
func (r PortRange) Contains(proto uint8, port uint16) bool {
	return (r.Protocol == ProtocolAny || uint8(r.Protocol) == proto) && r.First <= port && port <= r.Last
}

func (r PortRange) String() string {
	switch {
	case r.First == 0 && r.Last == 65535:
		return r.Protocol.String()
	case r.First == r.Last:
		return fmt.Sprintf("%s/%d", r.Protocol, r.First)
	}
	return fmt.Sprintf("%s/%d-%d", r.Protocol, r.First, r.Last)
}

// allPorts is what a rule without ports allows.
var allPorts = PortRange{ProtocolAny, 0, 65535}

// Rule allows remote addresses in CIDR but not in any Except, on Ports.
// Parsing never leaves Ports empty ("no ports" becomes allPorts); a
// hand-built Rule with no Ports allows nothing.
type Rule struct {
	CIDR   netip.Prefix
	Except []netip.Prefix
	Ports  []PortRange
}

// Endpoint is a pod a document selects (spec.podSelectorEndpoints[]).
type Endpoint struct{ Name, Namespace string }

// Document is one parsed PolicyEndpoint.
type Document struct {
	Source          string // "path#3": file and 0-based document index, for messages
	Name, Namespace string // metadata
	Selects         []Endpoint
	IsolateIngress  bool
	IsolateEgress   bool
	Ingress, Egress []Rule
}

// ParseFile parses every document of the file at path; see Parse.
func ParseFile(path string) ([]Document, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read policy file: %w", err)
	}
	defer f.Close()
	return Parse(f, path)
}

// IsDocumentFile reports whether LoadDir reads a file of this name.
func IsDocumentFile(name string) bool {
	if strings.HasPrefix(name, ".") {
		return false
	}
	return strings.HasSuffix(name, ".yaml") || strings.HasSuffix(name, ".yml") || strings.HasSuffix(name, ".json")
}

// LoadDir parses every *.yaml, *.yml and *.json file directly in dir, in name
// order. Hidden files are skipped, and so is anything that is not a regular
// file after following symlinks (a ConfigMap volume links its keys through
// "..data"). A missing dir holds no documents. Any file that fails fails the
// whole load, so that a half-read policy is never enforced.
func LoadDir(dir string) ([]Document, error) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read policy dir: %w", err)
	}
	var docs []Document
	for _, e := range entries {
		name := e.Name()
		if !IsDocumentFile(name) {
			continue
		}
		path := filepath.Join(dir, name)
		fi, err := os.Stat(path)
		if err != nil {
			return nil, fmt.Errorf("read policy file: %w", err)
		}
		if !fi.Mode().IsRegular() {
			continue
		}
		d, err := ParseFile(path)
		if err != nil {
			return nil, err
		}
		docs = append(docs, d...)
	}
	return docs, nil
}

// Parse reads PolicyEndpoint documents separated by "---" lines. JSON is
// YAML, so a JSON file holding one object parses too. Empty documents (only
// comments or whitespace) are skipped but still count in the index that
// Document.Source and error messages carry. source names the input in those.
func Parse(r io.Reader, source string) ([]Document, error) {
	data, err := io.ReadAll(r)
	if err != nil {
		return nil, fmt.Errorf("read policy file %s: %w", source, err)
	}
	var docs []Document
	for i, chunk := range splitDocuments(data) {
		doc, ok, err := parseDocument(chunk, fmt.Sprintf("%s#%d", source, i))
		if err != nil {
			return nil, err
		}
		if ok {
			docs = append(docs, doc)
		}
	}
	return docs, nil
}

// splitDocuments splits a YAML stream at document markers: lines that are
// "---" alone or followed by blanks and more (a comment, or inline content
// that belongs to the next document). Block scalars are indented, so a marker
// cannot occur inside one for this schema, which keeps this simpler than a
// YAML event parser. Each chunk is padded with newlines, and the marker
// replaced by blanks, so that YAML errors report lines and columns of the
// whole file. A blank preamble before the first marker is not a document,
// as in YAML.
func splitDocuments(data []byte) [][]byte {
	var chunks [][]byte
	var cur []byte
	lines := bytes.SplitAfter(data, []byte("\n"))
	for n, line := range lines {
		trimmed := bytes.TrimRight(line, "\r\n")
		if bytes.HasPrefix(trimmed, []byte("---")) && (len(trimmed) == 3 || trimmed[3] == ' ' || trimmed[3] == '\t') {
			if len(chunks) > 0 || !blank(cur) {
				chunks = append(chunks, cur)
			}
			cur = append(bytes.Repeat([]byte("\n"), n), "   "...)
			cur = append(cur, line[3:]...)
			continue
		}
		cur = append(cur, line...)
	}
	if len(chunks) > 0 || !blank(cur) {
		chunks = append(chunks, cur)
	}
	return chunks
}

// blank reports whether a chunk has nothing but whitespace and comments.
func blank(chunk []byte) bool {
	for _, line := range bytes.Split(chunk, []byte("\n")) {
		line = bytes.TrimSpace(line)
		if len(line) > 0 && line[0] != '#' {
			return false
		}
	}
	return true
}

// parseDocument parses one document; ok is false for an empty one.
func parseDocument(y []byte, src string) (doc Document, ok bool, err error) {
	// Strict conversion rejects duplicate keys, which would otherwise let
	// the last of two "cidr:" lines win silently.
	j, err := yaml.YAMLToJSONStrict(y)
	if err != nil {
		return Document{}, false, fmt.Errorf("%s: %w: %w", src, err, ErrInvalidDocument)
	}
	if string(j) == "null" {
		return Document{}, false, nil
	}
	top, err := newObject(src, "", j, nil)
	if err != nil {
		return Document{}, false, err
	}
	doc.Source = src
	for _, kv := range [][2]string{{"apiVersion", apiVersion}, {"kind", kind}} {
		key, want := kv[0], kv[1]
		got, err := top.str(key, true)
		if err != nil {
			return Document{}, false, err
		}
		if got != want {
			return Document{}, false, invalid(src, key, "%q is not %s", got, want)
		}
	}
	if raw, ok := top.raw("metadata"); ok {
		meta, err := newObject(src, "metadata", raw, nil)
		if err != nil {
			return Document{}, false, err
		}
		if doc.Name, err = meta.str("name", false); err != nil {
			return Document{}, false, err
		}
		if doc.Namespace, err = meta.str("namespace", false); err != nil {
			return Document{}, false, err
		}
	}
	raw, ok := top.raw("spec")
	if !ok {
		return Document{}, false, invalid(src, "spec", "missing")
	}
	if err := doc.parseSpec(raw); err != nil {
		return Document{}, false, err
	}
	return doc, true, nil
}

// parseSpec fills doc from spec. podSelector and policyRef describe where the
// controller got the document from and are accepted without being read.
func (doc *Document) parseSpec(raw json.RawMessage) error {
	spec, err := newObject(doc.Source, "spec", raw,
		[]string{"podIsolation", "podSelectorEndpoints", "ingress", "egress", "podSelector", "policyRef"})
	if err != nil {
		return err
	}
	isolation, err := spec.list("podIsolation")
	if err != nil {
		return err
	}
	for i, raw := range isolation {
		field := fmt.Sprintf("spec.podIsolation[%d]", i)
		s, err := str(doc.Source, field, raw)
		if err != nil {
			return err
		}
		switch s {
		case "Ingress":
			doc.IsolateIngress = true
		case "Egress":
			doc.IsolateEgress = true
		default:
			return invalid(doc.Source, field, "%q is not Ingress or Egress", s)
		}
	}
	endpoints, err := spec.list("podSelectorEndpoints")
	if err != nil {
		return err
	}
	for i, raw := range endpoints {
		ep, err := newObject(doc.Source, fmt.Sprintf("spec.podSelectorEndpoints[%d]", i), raw,
			[]string{"name", "namespace", "podIP", "hostIP"})
		if err != nil {
			return err
		}
		var e Endpoint
		if e.Name, err = ep.str("name", true); err != nil {
			return err
		}
		if e.Namespace, err = ep.str("namespace", true); err != nil {
			return err
		}
		doc.Selects = append(doc.Selects, e)
	}
	if doc.Ingress, err = parseRules(spec, "ingress"); err != nil {
		return err
	}
	doc.Egress, err = parseRules(spec, "egress")
	return err
}

func parseRules(spec object, key string) ([]Rule, error) {
	list, err := spec.list(key)
	if err != nil {
		return nil, err
	}
	var rules []Rule
	for i, raw := range list {
		o, err := newObject(spec.src, fmt.Sprintf("spec.%s[%d]", key, i), raw, []string{"cidr", "except", "ports"})
		if err != nil {
			return nil, err
		}
		r, err := parseRule(o)
		if err != nil {
			return nil, err
		}
		rules = append(rules, r)
	}
	return rules, nil
}

func parseRule(o object) (Rule, error) {
	var r Rule
	s, err := o.str("cidr", true)
	if err != nil {
		return r, err
	}
	if r.CIDR, err = parsePrefix(o.src, o.field("cidr"), s); err != nil {
		return r, err
	}
	except, err := o.list("except")
	if err != nil {
		return r, err
	}
	for i, raw := range except {
		field := fmt.Sprintf("%s[%d]", o.field("except"), i)
		s, err := str(o.src, field, raw)
		if err != nil {
			return r, err
		}
		e, err := parsePrefix(o.src, field, s)
		if err != nil {
			return r, err
		}
		switch {
		case e.Addr().Is4() != r.CIDR.Addr().Is4():
			return r, invalid(o.src, field, "%s is not of the address family of cidr %s", e, r.CIDR)
		case e.Bits() < r.CIDR.Bits() || !r.CIDR.Contains(e.Addr()):
			return r, invalid(o.src, field, "%s is not inside cidr %s", e, r.CIDR)
		}
		r.Except = append(r.Except, e)
	}
	ports, err := o.list("ports")
	if err != nil {
		return r, err
	}
	for i, raw := range ports {
		p, err := newObject(o.src, fmt.Sprintf("%s[%d]", o.field("ports"), i), raw, []string{"protocol", "port", "endPort"})
		if err != nil {
			return r, err
		}
		pr, err := parsePort(p)
		if err != nil {
			return r, err
		}
		r.Ports = append(r.Ports, pr)
	}
	if len(r.Ports) == 0 {
		r.Ports = []PortRange{allPorts}
	}
	return r, nil
}

// parsePrefix accepts a CIDR or a bare address (a host prefix). Host bits are
// masked off, as Kubernetes does. IPv4-mapped IPv6 prefixes are refused: the
// datapath sees IPv4 packets as IPv4, so such a rule could never match and
// would only hide a mistake.
func parsePrefix(src, field, s string) (netip.Prefix, error) {
	p, err := netip.ParsePrefix(s)
	if err != nil {
		a, aerr := netip.ParseAddr(s)
		if aerr != nil || a.Zone() != "" {
			return p, invalid(src, field, "%q is not a CIDR or IP address", s)
		}
		p = netip.PrefixFrom(a, a.BitLen())
	}
	if p.Addr().Is4In6() {
		return p, invalid(src, field, "%q is an IPv4-mapped IPv6 prefix; write it as IPv4", s)
	}
	return p.Masked(), nil
}

func parsePort(o object) (PortRange, error) {
	r := PortRange{Protocol: ProtocolTCP, First: 0, Last: 65535}
	proto, err := o.str("protocol", false)
	if err != nil {
		return r, err
	}
	switch proto {
	case "", "TCP":
	case "UDP":
		r.Protocol = ProtocolUDP
	case "SCTP":
		r.Protocol = ProtocolSCTP
	default:
		return r, invalid(o.src, o.field("protocol"), "%q is not TCP, UDP or SCTP", proto)
	}
	port, hasPort, err := o.port("port")
	if err != nil {
		return r, err
	}
	end, hasEnd, err := o.port("endPort")
	if err != nil {
		return r, err
	}
	switch {
	case hasEnd && !hasPort:
		return r, invalid(o.src, o.field("endPort"), "requires port")
	case hasEnd && end < port:
		return r, invalid(o.src, o.field("endPort"), "%d is below port %d", end, port)
	case hasEnd:
		r.First, r.Last = port, end
	case hasPort:
		r.First, r.Last = port, port
	}
	return r, nil
}

// object is one JSON object of a document with the path that names it in
// messages. Keys are matched exactly: encoding/json would match "CIDR" to a
// "cidr" field, and a key in the wrong case is a typo like any other.
type object struct {
	src, path string
	m         map[string]json.RawMessage
}

// newObject decodes raw as an object. With known non-nil, any other key is an
// error; with nil, every key is accepted (top level, metadata).
func newObject(src, path string, raw json.RawMessage, known []string) (object, error) {
	o := object{src: src, path: path}
	if k := jsonKind(raw); k != "mapping" {
		if path == "" {
			return o, invalid(src, "", "document is not a mapping but %s", k)
		}
		return o, invalid(src, path, "must be a mapping, not %s", k)
	}
	if err := json.Unmarshal(raw, &o.m); err != nil {
		return o, invalid(src, path, "%v", err)
	}
	if known != nil {
		keys := make([]string, 0, len(o.m))
		for k := range o.m {
			keys = append(keys, k)
		}
		slices.Sort(keys) // report the same key every time
		for _, k := range keys {
			if !slices.Contains(known, k) {
				return o, invalid(src, o.field(k), "unknown field (known: %s)", strings.Join(known, ", "))
			}
		}
	}
	return o, nil
}

func (o object) field(key string) string {
	if o.path == "" {
		return key
	}
	return o.path + "." + key
}

// raw returns the value of key; an explicit null counts as absent, as it
// does for Kubernetes optional fields.
func (o object) raw(key string) (json.RawMessage, bool) {
	v, ok := o.m[key]
	if !ok || string(v) == "null" {
		return nil, false
	}
	return v, true
}

func (o object) str(key string, required bool) (string, error) {
	v, ok := o.raw(key)
	if !ok {
		if required {
			return "", invalid(o.src, o.field(key), "missing")
		}
		return "", nil
	}
	s, err := str(o.src, o.field(key), v)
	if err == nil && s == "" && required {
		err = invalid(o.src, o.field(key), "must not be empty")
	}
	return s, err
}

func str(src, field string, raw json.RawMessage) (string, error) {
	var s string
	if k := jsonKind(raw); k != "string" {
		return "", invalid(src, field, "must be a string, not %s", k)
	}
	if err := json.Unmarshal(raw, &s); err != nil {
		return "", invalid(src, field, "%v", err)
	}
	return s, nil
}

// port returns key as a port number 1..65535.
func (o object) port(key string) (uint16, bool, error) {
	v, ok := o.raw(key)
	if !ok {
		return 0, false, nil
	}
	if k := jsonKind(v); k != "number" {
		return 0, false, invalid(o.src, o.field(key), "must be a number, not %s", k)
	}
	n, err := strconv.ParseInt(string(v), 10, 64)
	if err != nil || n < 1 || n > 65535 {
		return 0, false, invalid(o.src, o.field(key), "%s is not a port number in 1..65535", v)
	}
	return uint16(n), true, nil
}

func (o object) list(key string) ([]json.RawMessage, error) {
	v, ok := o.raw(key)
	if !ok {
		return nil, nil
	}
	if k := jsonKind(v); k != "list" {
		return nil, invalid(o.src, o.field(key), "must be a list, not %s", k)
	}
	var l []json.RawMessage
	if err := json.Unmarshal(v, &l); err != nil {
		return nil, invalid(o.src, o.field(key), "%v", err)
	}
	return l, nil
}

// jsonKind names the kind of a JSON value in YAML's words, for messages.
func jsonKind(raw json.RawMessage) string {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return "empty"
	}
	switch c := raw[0]; {
	case c == '{':
		return "mapping"
	case c == '[':
		return "list"
	case c == '"':
		return "string"
	case c == 't' || c == 'f':
		return "boolean"
	case c == 'n':
		return "null"
	}
	return "number"
}
