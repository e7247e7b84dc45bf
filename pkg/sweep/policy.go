package sweep

import (
	"errors"
	"fmt"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/policy"
)

// ReapplyPolicies programs every identifier that has members with what
// policyDir says for it, in the mode its state records, under its lock:
// after the node's addresses change, the tries' always-allowed entries
// follow (bpf.Identifier.ApplyPolicy writes them). It returns how many
// identifiers it programmed. An invalid policy directory changes nothing.
func ReapplyPolicies(g *bpf.Global, pinRoot, policyDir string) (int, error) {
	docs, err := policy.LoadDir(policyDir)
	if err != nil {
		return 0, fmt.Errorf("policy directory %s: %w", policyDir, err)
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
			info, err := bpf.InspectIdentifier(pinRoot, id)
			if err != nil {
				return err
			}
			ident, err := bpf.OpenIdentifier(g, pinRoot, id)
			if err != nil {
				return err
			}
			defer ident.Close()
			if err := ident.ApplyPolicy(policy.ForIdentifier(docs, id, info.Mode)); err != nil {
				return err
			}
			n++
			return nil
		}()
		if err != nil {
			errs = append(errs, fmt.Errorf("identifier %q: %w", id, err))
		}
	}
	return n, errors.Join(errs...)
}
