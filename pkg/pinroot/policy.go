package pinroot

import (
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/pinfs"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/pkg/policy"
)

// ErrInvalidPolicy is wrapped when the policy directory cannot be read:
// nothing was changed, and every identifier keeps its last good policy.
// (A document that does not parse is not this: see policy.ReadDir.)
var ErrInvalidPolicy = errors.New("invalid policy directory")

// Applied is what one ReapplyPolicies did.
type Applied struct {
	Identifiers int // programmed
	// Documents read, those that do not parse (Broken) and the rules left
	// out (NotEnforced); Problems says what of them, one line each, as ls
	// shows it (ReadPolicyStatus).
	Documents, Broken, NotEnforced int
	Problems                       []string
	// KeepErr is why the last good versions could not be recorded (a
	// read-only policy directory): enforcement goes on, without them.
	KeepErr error
	// Changed is, by document (namespace/name), when the controller last
	// changed it, for the documents that say (policy.ChangeTimeAnnotation).
	Changed map[string]time.Time
	// Digest is the directory's, as read; Unchanged says it was the one
	// the caller named, and nothing was programmed.
	Digest    policy.Digest
	Unchanged bool
}

// ReapplyPolicies programs every identifier that has members with what
// policyDir says for it, in the mode its state records, under its lock:
// after the node's addresses change, the tries' always-allowed entries
// follow (bpf.Datapath.ApplyPolicy writes them). A document that does
// not parse affects only the pods it selects (policy.ReadDir), and each
// file that parses whole is kept as the last good version of its
// documents. A policy directory that cannot be read changes nothing. What
// the load found is recorded in the pin root for ls (ReadPolicyStatus). A
// directory whose mirror has not synced yet (policy.ErrUnsynced) changes
// nothing either: the identifiers keep enforcing what they have.
//
// A directory whose digest is unless (the one the caller last programmed)
// is not programmed again: every identifier has it already, and an ADD
// programs its own. The zero digest programs whatever the directory holds.
func (n *Root) ReapplyPolicies(policyDir string, unless policy.Digest) (Applied, error) {
	var a Applied
	switch synced, err := policy.Synced(policyDir); {
	case err != nil:
		return a, err
	case !synced:
		return a, fmt.Errorf("%s: %w", policyDir, policy.ErrUnsynced)
	}
	dir, err := policy.ReadDir(policyDir)
	if err != nil {
		err = fmt.Errorf("%w %s: %w", ErrInvalidPolicy, policyDir, err)
		return a, errors.Join(err, n.recordPolicyStatus(err, nil))
	}
	if a.Digest = dir.Digest(); a.Digest == unless {
		a.Unchanged = true
		return a, nil
	}
	a.KeepErr = dir.KeepLastGood()
	docs, cluster := dir.Documents(), dir.ClusterDocuments()
	for _, d := range cluster {
		for _, n := range d.Notes {
			a.Problems = append(a.Problems, fmt.Sprintf("%s %s: %s", d.Source, n.Field, n.What))
		}
	}
	a.Documents = len(docs)
	for _, d := range docs {
		if d.Broken != nil {
			a.Broken++
		}
		a.NotEnforced += d.NotEnforcedRules()
		a.Problems = append(a.Problems, d.Report()...)
		if !d.ChangedAt.IsZero() {
			if a.Changed == nil {
				a.Changed = map[string]time.Time{}
			}
			a.Changed[d.Namespace+"/"+d.Name] = d.ChangedAt
		}
	}
	if err := n.recordPolicyStatus(nil, a.Problems); err != nil {
		return a, err
	}
	ids, err := n.Identifiers()
	if err != nil {
		return a, err
	}
	var errs []error
	var batch []*switched
	for _, id := range ids {
		sw, err := n.switchPolicy(id, func(mode policy.Mode) policy.Set {
			return policy.ForIdentifier(docs, id, mode).WithCluster(cluster, id)
		})
		if sw != nil {
			a.Identifiers++
			batch = append(batch, sw)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("identifier %q: %w", id, err))
		}
		if len(batch) == levelBatch {
			errs = append(errs, level(batch))
			batch = batch[:0]
		}
	}
	errs = append(errs, level(batch))
	return a, errors.Join(errs...)
}

// levelBatch is how many identifiers a push puts their new policy in force
// on before it waits, once, for the programs that may still read the sides
// they left (bpf.WaitForPrograms), and levels those: one grace period per
// batch rather than per identifier, while the batch's locks are held (an
// ADD of one of them waits for the batch).
const levelBatch = 32

// switched is an identifier whose new policy is in force, held until the
// side it left is level.
type switched struct {
	h     *Hold
	ident *bpf.Datapath
	lv    *bpf.Leveling // nil: nothing left to do
}

// switchPolicy programs id, when it has members, with what want says for
// the mode its state records, up to the switch (bpf.SwitchPolicy); nil
// when there is nothing to program or it failed.
func (n *Root) switchPolicy(id podid.ID, want func(policy.Mode) policy.Set) (*switched, error) {
	h, err := n.inUse(id)
	if h == nil {
		return nil, err // gone, or no member: nothing attached to program
	}
	ident, up, err := h.Open()
	if err == nil {
		var mode policy.Mode
		if mode, err = ident.Mode(); err == nil {
			var lv *bpf.Leveling
			if lv, err = ident.SwitchPolicy(want(mode)); err == nil {
				// Programmed all the same: the members named stay on
				// the earlier programs until a later push moves them.
				return &switched{h: h, ident: ident, lv: lv}, up.Unmoved
			}
		}
		ident.Close()
	}
	h.Unlock()
	return nil, err
}

// level waits once for the programs that may read the sides the batch's
// changes left, levels them, and lets the identifiers go.
// Should the wait fail, each identifier's next change levels it.
func level(batch []*switched) error {
	var waitErr error
	if slices.ContainsFunc(batch, func(sw *switched) bool { return sw.lv != nil }) {
		waitErr = bpf.WaitForPrograms()
	}
	errs := []error{waitErr}
	for _, sw := range batch {
		if sw.lv != nil && waitErr == nil {
			if err := sw.lv.Level(); err != nil {
				errs = append(errs, fmt.Errorf("identifier %q: %w", sw.ident.ID, err))
			}
		}
		sw.ident.Close()
		sw.h.Unlock()
	}
	return errors.Join(errs...)
}

// PolicyStatus is what the last load of the policy directory found: why
// it could not be read (Error), or what of its documents is not enforced
// as written (Problems, the first of them when there are many; More says
// how many more), since Since.
type PolicyStatus struct {
	Error    string
	Problems []string
	More     int
	Since    time.Time
}

// maxStatusError keeps the record's symlink target below PATH_MAX.
const maxStatusError = 2048

// recordPolicyStatus records the outcome of loading the policy directory
// in the pin root, for ls: an error, or the problems of a directory that
// loaded; nothing to say removes the record. The time of the first such
// load in a row is kept. The record is a symlink whose target must stay
// below PATH_MAX: the problems beyond maxStatusError bytes are counted.
func (n *Root) recordPolicyStatus(err error, problems []string) error {
	pinRoot := n.Path()
	path := pinpath.Root(pinRoot).PolicyError()
	if err == nil && len(problems) == 0 {
		if rerr := os.Remove(path); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
			return fmt.Errorf("remove the policy error record: %w", rerr)
		}
		return nil
	}
	since := time.Now()
	if old, ok, _ := n.ReadPolicyStatus(); ok {
		since = old.Since
	}
	v := url.Values{"since": {since.UTC().Format(time.RFC3339Nano)}}
	if err != nil {
		msg := err.Error()
		if len(msg) > maxStatusError {
			msg = msg[:maxStatusError]
		}
		v.Set("error", msg)
	}
	size := 0
	for i, p := range problems {
		if size += len(p); size > maxStatusError {
			v.Set("more", strconv.Itoa(len(problems)-i))
			break
		}
		v.Add("problem", p)
	}
	// bpffs holds no regular files; a symlink renamed over the old one
	// replaces it atomically.
	_ = os.Remove(filepath.Join(pinRoot, pinpath.PolicyErrorTempV2))
	if err := pinfs.WriteRecord(path, v.Encode()); err != nil {
		return fmt.Errorf("record the policy error: %w", err)
	}
	return nil
}

// ReadPolicyStatus reads the record ReapplyPolicies left; false when
// the policy directory loaded with nothing to report.
func (n *Root) ReadPolicyStatus() (PolicyStatus, bool, error) {
	target, ok, err := pinfs.ReadRecord(pinpath.Root(n.Path()).PolicyError())
	if err != nil {
		return PolicyStatus{}, false, fmt.Errorf("read the policy error record: %w", err)
	}
	if !ok {
		return PolicyStatus{}, false, nil
	}
	v, err := url.ParseQuery(target)
	if err != nil {
		return PolicyStatus{}, false, fmt.Errorf("read the policy error record: %w", err)
	}
	since, err := time.Parse(time.RFC3339Nano, v.Get("since"))
	if err != nil {
		return PolicyStatus{}, false, fmt.Errorf("read the policy error record: %w", err)
	}
	more, _ := strconv.Atoi(v.Get("more"))
	return PolicyStatus{Error: v.Get("error"), Problems: v["problem"], More: more, Since: since}, true, nil
}
