package bound

import (
	"fmt"

	"github.com/cilium/ebpf"
)

// Objects are the two programs and their maps, created unpinned.
type Objects struct {
	boundObjects
}

// Load creates the maps and loads the programs. Close releases them.
func Load() (*Objects, error) {
	var o Objects
	if err := loadBoundObjects(&o.boundObjects, nil); err != nil {
		return nil, fmt.Errorf("load lower-bound programs: %w", err)
	}
	return &o, nil
}

// Spec is the collection Load creates, for comparing its maps with the
// datapath's.
func Spec() (*ebpf.CollectionSpec, error) {
	return loadBound()
}
