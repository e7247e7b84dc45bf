package policy

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
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
	"time"

	"sigs.k8s.io/yaml"

	"github.com/podfence/podfence/pkg/atomicfile"
	"github.com/podfence/podfence/pkg/ipproto"
)

const (
	apiVersion = "networking.k8s.aws/v1alpha1"
	kind       = "PolicyEndpoint"
	// ChangeTimeAnnotation is when the network-policy controller wrote a
	// PolicyEndpoint, which the sweeper's mirror carries into its file.
	ChangeTimeAnnotation = "networking.k8s.aws/last-change-trigger-time"
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
	if p == ProtocolAny {
		return "any"
	}
	return ipproto.Name(uint8(p))
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
	// ChangedAt is when the controller last changed the document
	// (ChangeTimeAnnotation), zero when it does not say.
	ChangedAt time.Time
	// Policy names the NetworkPolicy the document is a chunk of
	// (spec.policyRef, "namespace/name"), empty when it names none. The
	// controller packs a policy's rules and its selected pods into
	// chunks of at most 200 entries each, independently: a chunk may hold
	// rules and no pod. Every chunk of a policy applies to the pods any
	// of them selects (see ForIdentifier).
	Policy          string
	Selects         []Endpoint
	IsolateIngress  bool
	IsolateEgress   bool
	Ingress, Egress []Rule

	// Notes are what the document says that podfence does not enforce as
	// written: rules it cannot enforce (a domainName, a field it does not
	// know inside a rule), which are left out and so allow nothing, and
	// fields it does not know elsewhere, which are ignored. Never more
	// open than the document: its isolation and every other rule apply.
	Notes []Note
	// Broken is why the document does not parse, or nil. A broken
	// document enforces what Fallback says instead.
	Broken   error
	Fallback Fallback
}

// Note is one thing of a document that podfence does not enforce.
type Note struct {
	Field string `json:"field"` // "spec.egress[0]"
	What  string `json:"what"`  // what podfence does with it, and why
	// Rule is true for a rule left out (it allows nothing), false for a
	// field that is ignored.
	Rule bool `json:"rule"`
}

// Fallback is what a document that does not parse enforces.
type Fallback uint8

const (
	// FallbackNone: the document parsed.
	FallbackNone Fallback = iota
	// FallbackLastGood: the last version of it that parsed (LoadDir keeps
	// one per file, see Dir.KeepLastGood), so that a typo in an update
	// does not cut live pods off.
	FallbackLastGood
	// FallbackIsolation: no earlier version; its selection and isolation
	// parsed, and apply with no rule: the pods it names are closed in the
	// directions it names.
	FallbackIsolation
	// FallbackNothing: not even those parsed; it changes nothing.
	FallbackNothing
)

func (f Fallback) String() string {
	switch f {
	case FallbackNone:
		return "enforced"
	case FallbackLastGood:
		return "its last good version is enforced"
	case FallbackIsolation:
		return "it isolates the pods it names in the directions it names, allowing nothing"
	case FallbackNothing:
		return "it changes nothing (not even the pods it selects could be read)"
	}
	return fmt.Sprintf("fallback(%d)", uint8(f))
}

// Report lists, one line each, what podfence does not enforce of d as
// written, for logs and ls: empty for a document enforced as written.
func (d Document) Report() []string {
	who := d.Source
	if d.Name != "" {
		who += " (" + d.Namespace + "/" + d.Name + ")"
	}
	var out []string
	if d.Broken != nil {
		out = append(out, fmt.Sprintf("%s: does not parse: %v; %s", who, d.Broken, d.Fallback))
	}
	for _, n := range d.Notes {
		out = append(out, fmt.Sprintf("%s: %s: %s", who, n.Field, n.What))
	}
	return out
}

// NotEnforcedRules counts the rules of d left out, and so allowing nothing.
func (d Document) NotEnforcedRules() int {
	n := 0
	for _, note := range d.Notes {
		if note.Rule {
			n++
		}
	}
	return n
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
// order; see ReadDir. The error is for reading the directory or a file.
func LoadDir(dir string) ([]Document, error) {
	d, err := ReadDir(dir)
	if err != nil {
		return nil, err
	}
	return d.Documents(), nil
}

// Dir is what a policy directory held when ReadDir read it.
type Dir struct {
	Path  string
	Files []File
	// Cluster are the files of its ClusterDir.
	Cluster []ClusterFile
}

// File is one document file of a Dir: its content and documents.
type File struct {
	Name string
	Data []byte
	Docs []Document
	// LastGood is the last good copy its broken documents were replaced
	// from, if any.
	LastGood []byte
}

// Digest identifies what a Dir holds: two reads with the same digest give
// the same documents.
type Digest [sha256.Size]byte

// Digest is the digest of every file's name and content, and of the last
// good copies its broken documents fell back to.
func (d *Dir) Digest() Digest {
	h := sha256.New()
	var n [8]byte
	field := func(b []byte) {
		binary.LittleEndian.PutUint64(n[:], uint64(len(b)))
		h.Write(n[:])
		h.Write(b)
	}
	for _, f := range d.Files {
		field([]byte(f.Name))
		field(f.Data)
		field(f.LastGood)
	}
	for _, f := range d.Cluster {
		field([]byte(ClusterDir + "/" + f.Name))
		field(f.Data)
	}
	var out Digest
	h.Sum(out[:0])
	return out
}

// lastGoodDir keeps, below the policy directory, a copy of each document
// file as it was when it last parsed whole. The name is hidden, so
// LoadDir and the directory watcher skip it.
const lastGoodDir = ".podfence-last-good"

// ReadDir reads every document file directly in dir, in name order, and
// those of its ClusterDir (see readCluster: one that does not parse fails
// the read).
// Hidden files are skipped, and so is anything that is not a regular file
// after following symlinks (a ConfigMap volume links its keys through
// "..data"). A missing dir holds no documents. A document that does not
// parse is replaced by its last good version when KeepLastGood recorded
// one (the same metadata namespace and name, or for a document without
// them the same index, in the same file), else by what Parse salvaged of it.
func ReadDir(dir string) (*Dir, error) {
	d := &Dir{Path: dir}
	err := readDocumentFiles(dir, "policy", func(name, path string, data []byte) error {
		f := File{Name: name, Data: data, Docs: parseData(data, path)}
		if Strict(f.Docs) != nil {
			f.Docs, f.LastGood = withLastGood(f.Docs, filepath.Join(dir, lastGoodDir, name))
		}
		d.Files = append(d.Files, f)
		return nil
	})
	if err != nil {
		return nil, err
	}
	if d.Cluster, err = readCluster(filepath.Join(dir, ClusterDir)); err != nil {
		return nil, err
	}
	return d, nil
}

// readDocumentFiles calls each with the name, path and content of every
// document file directly in dir, in name order: hidden files are skipped,
// and so is anything that is not a regular file after following symlinks
// (a ConfigMap volume links its keys through "..data"). A missing dir
// holds none. what names the directory's kind in errors.
func readDocumentFiles(dir, what string, each func(name, path string, data []byte) error) error {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read %s dir: %w", what, err)
	}
	for _, e := range entries {
		name := e.Name()
		if !IsDocumentFile(name) {
			continue
		}
		path := filepath.Join(dir, name)
		fi, err := os.Stat(path)
		if err != nil {
			return fmt.Errorf("read %s file: %w", what, err)
		}
		if !fi.Mode().IsRegular() {
			continue
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return fmt.Errorf("read %s file: %w", what, err)
		}
		if err := each(name, path, data); err != nil {
			return err
		}
	}
	return nil
}

// Documents are the documents of every file, in order.
func (d *Dir) Documents() []Document {
	var out []Document
	for _, f := range d.Files {
		out = append(out, f.Docs...)
	}
	return out
}

// withLastGood puts in place of each broken document of docs its version
// in the last good copy of its file (path), where it has one, and returns
// the copy it read.
func withLastGood(docs []Document, path string) ([]Document, []byte) {
	data, err := os.ReadFile(path)
	if err != nil {
		return docs, nil // none recorded (or unreadable): the salvage stands
	}
	good := parseData(data, path)
	out := make([]Document, len(docs))
	for i, d := range docs {
		out[i] = d
		if d.Broken == nil {
			continue
		}
		for _, g := range good {
			if d.Name != "" && (g.Name != d.Name || g.Namespace != d.Namespace) ||
				d.Name == "" && index(g.Source) != index(d.Source) {
				continue
			}
			if g.Broken == nil {
				g.Broken, g.Fallback = d.Broken, FallbackLastGood
				g.Source = d.Source
				out[i] = g
			}
			break
		}
	}
	return out, data
}

// index is the document index of a Source ("path#3").
func index(source string) string {
	_, i, _ := strings.Cut(source[strings.LastIndexByte(source, '/')+1:], "#")
	return i
}

// KeepLastGood records, below the directory, each file that parsed whole
// as the last good version of its documents, and forgets the files that are
// gone. Only what ReadDir read is recorded, never what a file holds now.
// The sweeper calls it after each load it programs; a directory it cannot
// write (a read-only volume) has no last good versions, which is an error
// here and a message for the caller's log.
func (d *Dir) KeepLastGood() error {
	keep := filepath.Join(d.Path, lastGoodDir)
	present := map[string]bool{}
	var errs []error
	for _, f := range d.Files {
		present[f.Name] = true
		if Strict(f.Docs) != nil {
			continue // its recorded version stays the last good one
		}
		path := filepath.Join(keep, f.Name)
		if old, err := os.ReadFile(path); err == nil && bytes.Equal(old, f.Data) {
			continue
		}
		if err := os.MkdirAll(keep, 0o755); err != nil {
			return fmt.Errorf("keep the last good policy: %w", err)
		}
		if err := atomicfile.Write(path, f.Data, atomicfile.Options{}); err != nil {
			errs = append(errs, fmt.Errorf("keep the last good version of %s: %w", f.Name, err))
		}
	}
	entries, err := os.ReadDir(keep)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return errors.Join(append(errs, fmt.Errorf("keep the last good policy: %w", err))...)
	}
	for _, e := range entries {
		if !present[e.Name()] {
			if err := os.Remove(filepath.Join(keep, e.Name())); err != nil && !errors.Is(err, fs.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// Parse reads PolicyEndpoint documents separated by "---" lines. JSON is
// YAML, so a JSON file holding one object parses too. Empty documents (only
// comments or whitespace) are skipped but still count in the index that
// Document.Source and error messages carry. source names the input in those.
//
// A document that does not parse is returned all the same, with Broken
// set and what could be salvaged of it (Fallback): one bad document
// affects only the pods it selects. The error is for reading r only.
func Parse(r io.Reader, source string) ([]Document, error) {
	data, err := io.ReadAll(r)
	if err != nil {
		return nil, fmt.Errorf("read policy file %s: %w", source, err)
	}
	return parseData(data, source), nil
}

func parseData(data []byte, source string) []Document {
	var docs []Document
	for i, chunk := range splitDocuments(data) {
		src := fmt.Sprintf("%s#%d", source, i)
		doc, ok, err := parseDocument(chunk, src)
		if err != nil {
			doc, ok = salvage(chunk, src, err), true
		}
		if ok {
			docs = append(docs, doc)
		}
	}
	return docs
}

// Strict is the first document's Broken error, or nil: for callers that
// accept only documents that parse whole (the mirror's check of an object,
// tests).
func Strict(docs []Document) error {
	for _, d := range docs {
		if d.Broken != nil {
			return d.Broken
		}
	}
	return nil
}

// salvage makes what it can of a document that does not parse (err): a
// PolicyEndpoint whose selection and isolation parse on their own keeps
// them, with no rule; anything else changes nothing. LoadDir may put its
// last good version in its place.
func salvage(chunk []byte, src string, err error) Document {
	doc := Document{Source: src, Broken: err, Fallback: FallbackNothing}
	j, jerr := yaml.YAMLToJSON(chunk) // duplicate keys are the error already reported
	if jerr != nil {
		return doc
	}
	top, terr := newObject(src, "", j)
	if terr != nil {
		return doc
	}
	if raw, ok := top.raw("metadata"); ok {
		if meta, err := newObject(src, "metadata", raw); err == nil {
			doc.Name, _ = meta.str("name", false)
			doc.Namespace, _ = meta.str("namespace", false)
		}
	}
	if k, _ := top.str("kind", true); k != kind {
		return doc
	}
	raw, ok := top.raw("spec")
	if !ok {
		return doc
	}
	spec, serr := newObject(src, "spec", raw)
	if serr != nil {
		return doc
	}
	part := Document{Source: src}
	if part.parseIsolation(spec) != nil || part.parseSelects(spec) != nil || part.parsePolicyRef(spec) != nil {
		return doc
	}
	doc.Selects, doc.IsolateIngress, doc.IsolateEgress = part.Selects, part.IsolateIngress, part.IsolateEgress
	doc.Policy = part.Policy
	doc.Fallback = FallbackIsolation
	return doc
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
	top, ok, err := topObject(y, src)
	if err != nil || !ok {
		return Document{}, false, err
	}
	doc.Source = src
	m, err := parseHeader(top, kind)
	if err != nil {
		return Document{}, false, err
	}
	doc.Name, doc.Namespace, doc.ChangedAt = m.Name, m.Namespace, m.ChangedAt
	raw, ok := top.raw("spec")
	if !ok {
		return Document{}, false, invalid(src, "spec", "missing")
	}
	if err := doc.parseSpec(raw); err != nil {
		return Document{}, false, err
	}
	return doc, true, nil
}

// topObject is the document y as an object; ok is false for an empty one.
func topObject(y []byte, src string) (top object, ok bool, err error) {
	// Strict conversion rejects duplicate keys, which would otherwise let
	// the last of two "cidr:" lines win silently.
	j, err := yaml.YAMLToJSONStrict(y)
	if err != nil {
		return top, false, fmt.Errorf("%s: %w: %w", src, err, ErrInvalidDocument)
	}
	if string(j) == "null" {
		return top, false, nil
	}
	top, err = newObject(src, "", j)
	return top, err == nil, err
}

// meta is what podfence reads of an object's metadata.
type meta struct {
	Name, Namespace string
	// ChangedAt is when the controller last changed the object
	// (ChangeTimeAnnotation), zero when it does not say.
	ChangedAt time.Time
}

// parseHeader checks top's apiVersion and kind and reads its metadata.
func parseHeader(top object, wantKind string) (m meta, err error) {
	for _, kv := range [][2]string{{"apiVersion", apiVersion}, {"kind", wantKind}} {
		key, want := kv[0], kv[1]
		got, err := top.str(key, true)
		if err != nil {
			return m, err
		}
		if got != want {
			return m, invalid(top.src, key, "%q is not %s", got, want)
		}
	}
	raw, ok := top.raw("metadata")
	if !ok {
		return m, nil
	}
	md, err := newObject(top.src, "metadata", raw)
	if err != nil {
		return m, err
	}
	if m.Name, err = md.str("name", false); err != nil {
		return m, err
	}
	if m.Namespace, err = md.str("namespace", false); err != nil {
		return m, err
	}
	// Informational only: an annotation that does not parse is no reason
	// to refuse the policy.
	if raw, ok := md.raw("annotations"); ok {
		if ann, err := newObject(top.src, "metadata.annotations", raw); err == nil {
			if s, err := ann.str(ChangeTimeAnnotation, false); err == nil {
				m.ChangedAt, _ = time.Parse(time.RFC3339Nano, s)
			}
		}
	}
	return m, nil
}

// specFields are the fields of spec that podfence knows. podSelector and
// policyRef describe where the controller got the document from and are
// accepted without being read.
var specFields = []string{"podIsolation", "podSelectorEndpoints", "ingress", "egress", "podSelector", "policyRef"}

// endpointFields, ruleFields and portFields are the fields of a
// podSelectorEndpoints entry, a rule, and a rule's port.
var (
	endpointFields = []string{"name", "namespace", "podIP", "hostIP"}
	ruleFields     = []string{"cidr", "except", "ports"}
	portFields     = []string{"protocol", "port", "endPort"}
	// notEnforcedRuleFields make a rule that podfence does not enforce
	// (it allows nothing); the controller writes a domainName from
	// ApplicationNetworkPolicy and ClusterNetworkPolicy objects.
	notEnforcedRuleFields = []string{"domainName"}
)

// parseSpec fills doc from spec. A field podfence does not know is
// noted and ignored; inside a rule, it leaves the rule out (see parseRules).
func (doc *Document) parseSpec(raw json.RawMessage) error {
	spec, err := newObject(doc.Source, "spec", raw)
	if err != nil {
		return err
	}
	doc.ignoreUnknown(spec, specFields)
	if err := doc.parseIsolation(spec); err != nil {
		return err
	}
	if err := doc.parseSelects(spec); err != nil {
		return err
	}
	if err := doc.parsePolicyRef(spec); err != nil {
		return err
	}
	if doc.Ingress, err = doc.parseRules(spec, "ingress"); err != nil {
		return err
	}
	doc.Egress, err = doc.parseRules(spec, "egress")
	return err
}

// ignoreUnknown notes every field of o that is not in known as ignored.
func (doc *Document) ignoreUnknown(o object, known []string) {
	for _, k := range o.unknown(known) {
		doc.Notes = append(doc.Notes, Note{Field: o.field(k), What: "unknown field, ignored (known: " + strings.Join(known, ", ") + ")"})
	}
}

// parsePolicyRef reads spec.policyRef, which ties a chunk to its policy.
func (doc *Document) parsePolicyRef(spec object) error {
	raw, ok := spec.raw("policyRef")
	if !ok {
		return nil
	}
	ref, err := newObject(doc.Source, "spec.policyRef", raw)
	if err != nil {
		return err
	}
	name, err := ref.str("name", true)
	if err != nil {
		return err
	}
	ns, err := ref.str("namespace", false)
	if err != nil {
		return err
	}
	doc.Policy = ns + "/" + name
	return nil
}

func (doc *Document) parseIsolation(spec object) error {
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
	return nil
}

func (doc *Document) parseSelects(spec object) (err error) {
	doc.Selects, err = parseEndpoints(spec, func(n Note) { doc.Notes = append(doc.Notes, n) })
	return err
}

// parseEndpoints reads spec.podSelectorEndpoints; note takes what is
// ignored.
func parseEndpoints(spec object, note func(Note)) ([]Endpoint, error) {
	endpoints, err := spec.list("podSelectorEndpoints")
	if err != nil {
		return nil, err
	}
	var out []Endpoint
	for i, raw := range endpoints {
		ep, err := newObject(spec.src, fmt.Sprintf("spec.podSelectorEndpoints[%d]", i), raw)
		if err != nil {
			return nil, err
		}
		for _, k := range ep.unknown(endpointFields) {
			note(Note{Field: ep.field(k), What: "unknown field, ignored (known: " + strings.Join(endpointFields, ", ") + ")"})
		}
		var e Endpoint
		if e.Name, err = ep.str("name", true); err != nil {
			return nil, err
		}
		if e.Namespace, err = ep.str("namespace", true); err != nil {
			return nil, err
		}
		out = append(out, e)
	}
	return out, nil
}

// parseRules parses the rules of spec's key. A rule that podfence cannot
// enforce as written, one with a domainName or a field (its own or a
// port's) that podfence does not know, is left out, so that it allows
// nothing, and noted; its values must still parse.
func (doc *Document) parseRules(spec object, key string) ([]Rule, error) {
	list, err := spec.list(key)
	if err != nil {
		return nil, err
	}
	var rules []Rule
	for i, raw := range list {
		o, err := newObject(spec.src, fmt.Sprintf("spec.%s[%d]", key, i), raw)
		if err != nil {
			return nil, err
		}
		if _, ok := o.raw(notEnforcedRuleFields[0]); ok {
			name, err := o.str(notEnforcedRuleFields[0], true)
			if err != nil {
				return nil, err
			}
			doc.Notes = append(doc.Notes, Note{Field: o.path, Rule: true,
				What: fmt.Sprintf("domainName %q is not enforced: the rule allows nothing", name)})
			continue
		}
		r, unknown, err := parseRule(o)
		if err != nil {
			return nil, err
		}
		if len(unknown) > 0 {
			doc.Notes = append(doc.Notes, Note{Field: o.path, Rule: true,
				What: fmt.Sprintf("unknown field %s: the rule is not enforced and allows nothing", strings.Join(unknown, ", "))})
			continue
		}
		rules = append(rules, r)
	}
	return rules, nil
}

// parseRule parses one rule; unknown names the fields in it (and in its
// ports) that podfence does not know.
func parseRule(o object) (r Rule, unknown []string, err error) {
	for _, k := range o.unknown(ruleFields) {
		unknown = append(unknown, o.field(k))
	}
	s, err := o.str("cidr", true)
	if err != nil {
		return r, nil, err
	}
	if r.CIDR, err = parsePrefix(o.src, o.field("cidr"), s); err != nil {
		return r, nil, err
	}
	except, err := o.list("except")
	if err != nil {
		return r, nil, err
	}
	for i, raw := range except {
		field := fmt.Sprintf("%s[%d]", o.field("except"), i)
		s, err := str(o.src, field, raw)
		if err != nil {
			return r, nil, err
		}
		e, err := parsePrefix(o.src, field, s)
		if err != nil {
			return r, nil, err
		}
		switch {
		case e.Addr().Is4() != r.CIDR.Addr().Is4():
			return r, nil, invalid(o.src, field, "%s is not of the address family of cidr %s", e, r.CIDR)
		case e.Bits() < r.CIDR.Bits() || !r.CIDR.Contains(e.Addr()):
			return r, nil, invalid(o.src, field, "%s is not inside cidr %s", e, r.CIDR)
		}
		r.Except = append(r.Except, e)
	}
	ports, unknownPorts, err := parsePorts(o)
	if err != nil {
		return r, nil, err
	}
	r.Ports = ports
	return r, append(unknown, unknownPorts...), nil
}

// parsePorts reads o's ports; none is allPorts. unknown names the fields
// of the ports that podfence does not know.
func parsePorts(o object) (ports []PortRange, unknown []string, err error) {
	list, err := o.list("ports")
	if err != nil {
		return nil, nil, err
	}
	for i, raw := range list {
		p, err := newObject(o.src, fmt.Sprintf("%s[%d]", o.field("ports"), i), raw)
		if err != nil {
			return nil, nil, err
		}
		for _, k := range p.unknown(portFields) {
			unknown = append(unknown, p.field(k))
		}
		pr, err := parsePort(p)
		if err != nil {
			return nil, nil, err
		}
		ports = append(ports, pr)
	}
	if len(ports) == 0 {
		ports = []PortRange{allPorts}
	}
	return ports, unknown, nil
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

// newObject decodes raw as an object; which keys it may have is the
// caller's to check (object.unknown).
func newObject(src, path string, raw json.RawMessage) (object, error) {
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
	return o, nil
}

// unknown lists o's keys that are not in known, in order.
func (o object) unknown(known []string) []string {
	var out []string
	for k := range o.m {
		if !slices.Contains(known, k) {
			out = append(out, k)
		}
	}
	slices.Sort(out) // report them in the same order every time
	return out
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

// integer reads key as a whole number in lo..hi; ok is false when absent.
func (o object) integer(key string, lo, hi int64) (n int64, ok bool, err error) {
	v, ok := o.raw(key)
	if !ok {
		return 0, false, nil
	}
	if k := jsonKind(v); k != "number" {
		return 0, false, invalid(o.src, o.field(key), "must be a number, not %s", k)
	}
	n, err = strconv.ParseInt(string(v), 10, 64)
	if err != nil || n < lo || n > hi {
		return 0, false, invalid(o.src, o.field(key), "%s is not a whole number in %d..%d", v, lo, hi)
	}
	return n, true, nil
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
