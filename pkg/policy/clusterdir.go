package policy

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// ClusterDir is the subdirectory of a policy directory that holds
// ClusterPolicyEndpoint files. It is apart from the PolicyEndpoints so that
// a build that does not know the kind, whose LoadDir would refuse it, never
// reads one (after a rollback, say).
const ClusterDir = "cluster"

// LoadCluster parses every document file directly in policyDir's
// ClusterDir, in name order; a missing ClusterDir holds none. Unlike
// LoadDir there is no salvage: a file that does not parse is an error
// naming it, since what it would have denied cannot be known, and
// enforcing the others alone could be more open than the objects.
func LoadCluster(policyDir string) ([]ClusterDocument, error) {
	dir := filepath.Join(policyDir, ClusterDir)
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read cluster policy dir: %w", err)
	}
	var docs []ClusterDocument
	for _, e := range entries {
		if !IsDocumentFile(e.Name()) {
			continue
		}
		path := filepath.Join(dir, e.Name())
		fi, err := os.Stat(path)
		if err != nil {
			return nil, fmt.Errorf("read cluster policy file: %w", err)
		}
		if !fi.Mode().IsRegular() {
			continue
		}
		f, err := os.Open(path)
		if err != nil {
			return nil, fmt.Errorf("read cluster policy file: %w", err)
		}
		d, err := ParseCluster(f, path)
		f.Close()
		if err != nil {
			return nil, err
		}
		docs = append(docs, d...)
	}
	return docs, nil
}
