package policy

import (
	"bytes"

	"github.com/podfence/podfence/pkg/podid"
)

// ClusterDir is the subdirectory of a policy directory that holds
// ClusterPolicyEndpoint files. It is apart from the PolicyEndpoints so that
// a build that does not know the kind, whose LoadDir would refuse it, never
// reads one (after a rollback, say).
const ClusterDir = "cluster"

// ClusterFile is one ClusterPolicyEndpoint file of a Dir.
type ClusterFile struct {
	Name string
	Data []byte
	Docs []ClusterDocument
}

// readCluster reads the document files directly in dir (a policy
// directory's ClusterDir), in name order; a missing dir holds none. Unlike
// PolicyEndpoints there is no salvage and no last good copy: a file that
// does not parse is an error naming it, since what it would deny cannot be
// known and enforcing the others alone could be more open than the
// objects.
func readCluster(dir string) ([]ClusterFile, error) {
	var files []ClusterFile
	err := readDocumentFiles(dir, "cluster policy", func(name, path string, data []byte) error {
		docs, err := ParseCluster(bytes.NewReader(data), path)
		if err != nil {
			return err
		}
		files = append(files, ClusterFile{Name: name, Data: data, Docs: docs})
		return nil
	})
	return files, err
}

// ClusterDocuments are the ClusterPolicyEndpoints of every cluster file,
// in order.
func (d *Dir) ClusterDocuments() []ClusterDocument {
	var out []ClusterDocument
	for _, f := range d.Cluster {
		out = append(out, f.Docs...)
	}
	return out
}

// WithCluster returns s with what the cluster documents say about id.
func (s Set) WithCluster(docs []ClusterDocument, id podid.ID) Set {
	s.Cluster = ClusterForIdentifier(docs, id)
	s.Problems = append(s.Problems, s.Cluster.Problems...)
	return s
}
