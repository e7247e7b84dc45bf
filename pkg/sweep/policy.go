package sweep

import (
	"errors"
	"fmt"
	"net/url"
	"os"
	"time"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/lifecycle"
	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/policy"
)

// ErrInvalidPolicy is wrapped when the policy directory does not load:
// nothing was changed, and every identifier keeps its last good policy.
var ErrInvalidPolicy = errors.New("invalid policy directory")

// ReapplyPolicies programs every identifier that has members with what
// policyDir says for it, in the mode its state records, under its lock:
// after the node's addresses change, the tries' always-allowed entries
// follow (bpf.Identifier.ApplyPolicy writes them). It returns how many
// identifiers it programmed. An invalid policy directory changes nothing;
// whether it loaded is recorded in the pin root for ls (ReadPolicyStatus).
// A directory whose mirror has not synced yet (policy.ErrUnsynced) changes
// nothing either: the identifiers keep enforcing what they have.
func ReapplyPolicies(g *bpf.Global, pinRoot, policyDir string) (int, error) {
	switch synced, err := policy.Synced(policyDir); {
	case err != nil:
		return 0, err
	case !synced:
		return 0, fmt.Errorf("%s: %w", policyDir, policy.ErrUnsynced)
	}
	docs, err := policy.LoadDir(policyDir)
	if err != nil {
		err = fmt.Errorf("%w %s: %w", ErrInvalidPolicy, policyDir, err)
		return 0, errors.Join(err, recordPolicyStatus(pinRoot, err))
	}
	if err := recordPolicyStatus(pinRoot, nil); err != nil {
		return 0, err
	}
	store := membership.New(pinRoot)
	ids, err := store.Identifiers()
	if err != nil {
		return 0, err
	}
	n := 0
	var errs []error
	for _, id := range ids {
		err := func() error {
			lock, err := store.Lock(id, false)
			if errors.Is(err, membership.ErrNoIdentifier) {
				return nil
			}
			if err != nil {
				return err
			}
			defer lock.Unlock()
			if sc, err := lock.Scan(); err != nil || !sc.InUse() {
				return err // no member: nothing attached to program
			}
			// Opened first: it takes over pins of an earlier build,
			// which InspectIdentifier would refuse.
			ident, up, err := lifecycle.OpenIdentifier(g, pinRoot, lock)
			if err != nil {
				return err
			}
			defer ident.Close()
			info, err := bpf.InspectIdentifier(pinRoot, id)
			if err != nil {
				return err
			}
			if err := ident.ApplyPolicy(policy.ForIdentifier(docs, id, info.Mode)); err != nil {
				return err
			}
			n++
			// Programmed all the same: the members named stay on the
			// earlier programs until a later push moves them.
			return up.Unmoved
		}()
		if err != nil {
			errs = append(errs, fmt.Errorf("identifier %q: %w", id, err))
		}
	}
	return n, errors.Join(errs...)
}

// PolicyStatus is why the policy directory was last refused.
type PolicyStatus struct {
	Error string
	Since time.Time
}

// maxStatusError keeps the record's symlink target below PATH_MAX.
const maxStatusError = 2048

// recordPolicyStatus records the outcome of loading the policy directory
// in the pin root, for ls: err nil removes the record; an error keeps the
// time of the first failure in a row.
func recordPolicyStatus(pinRoot string, err error) error {
	path := pinpath.Root(pinRoot).PolicyError()
	if err == nil {
		if rerr := os.Remove(path); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
			return fmt.Errorf("remove the policy error record: %w", rerr)
		}
		return nil
	}
	since := time.Now()
	if old, ok, _ := ReadPolicyStatus(pinRoot); ok {
		since = old.Since
	}
	msg := err.Error()
	if len(msg) > maxStatusError {
		msg = msg[:maxStatusError]
	}
	v := url.Values{"error": {msg}, "since": {since.UTC().Format(time.RFC3339Nano)}}
	// bpffs holds no regular files; a symlink renamed over the old one
	// replaces it atomically.
	tmp := path + "-new"
	_ = os.Remove(tmp)
	if err := os.Symlink(v.Encode(), tmp); err != nil {
		return fmt.Errorf("record the policy error: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("record the policy error: %w", err)
	}
	return nil
}

// ReadPolicyStatus reads the record ReapplyPolicies left; false when
// the policy directory was valid when last loaded.
func ReadPolicyStatus(pinRoot string) (PolicyStatus, bool, error) {
	target, err := os.Readlink(pinpath.Root(pinRoot).PolicyError())
	if errors.Is(err, os.ErrNotExist) {
		return PolicyStatus{}, false, nil
	}
	if err != nil {
		return PolicyStatus{}, false, fmt.Errorf("read the policy error record: %w", err)
	}
	v, err := url.ParseQuery(target)
	if err != nil {
		return PolicyStatus{}, false, fmt.Errorf("read the policy error record: %w", err)
	}
	since, err := time.Parse(time.RFC3339Nano, v.Get("since"))
	if err != nil {
		return PolicyStatus{}, false, fmt.Errorf("read the policy error record: %w", err)
	}
	return PolicyStatus{Error: v.Get("error"), Since: since}, true, nil
}
