package policy

import (
	"bytes"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
)

// FuzzDocument: any bytes in the policy directory parse into documents,
// never a panic, and a broken one keeps no rule; what parses compiles for
// the datapath (or is
// refused with one of the limit errors), and every compiled lookup answers
// as the direct evaluation does. The seeds are the example documents; the
// corpus testdata/fuzz/FuzzDocument keeps what the fuzzer found.
func FuzzDocument(f *testing.F) {
	seeds, _ := filepath.Glob("testdata/*.*")
	seeds = append(seeds, "../../conf/policies/web-allow.yaml")
	for _, path := range seeds {
		data, err := os.ReadFile(path)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data, []byte{192, 168, 7, 1}, uint8(6), uint16(8080))
	}
	f.Fuzz(func(t *testing.T, data, addr []byte, proto uint8, port uint16) {
		docs, err := Parse(bytes.NewReader(data), "fuzz.yaml")
		if err != nil {
			t.Fatalf("Parse of bytes in memory failed as a whole: %v", err)
		}
		// A broken document says why, and keeps no rule: at most its
		// selection and isolation, never more open than it says.
		for _, doc := range docs {
			switch {
			case doc.Broken == nil && doc.Fallback != FallbackNone:
				t.Fatalf("%s: fallback %s without an error", doc.Source, doc.Fallback)
			case doc.Broken == nil:
				continue
			case !errors.Is(doc.Broken, ErrInvalidDocument):
				t.Fatalf("%s: broken without ErrInvalidDocument: %v", doc.Source, doc.Broken)
			case len(doc.Ingress)+len(doc.Egress) != 0:
				t.Fatalf("%s: broken, with rules", doc.Source)
			case doc.Fallback == FallbackNothing && (len(doc.Selects) != 0 || doc.IsolateIngress || doc.IsolateEgress):
				t.Fatalf("%s: changes nothing, yet selects or isolates", doc.Source)
			case doc.Fallback != FallbackNothing && doc.Fallback != FallbackIsolation:
				t.Fatalf("%s: fallback %s out of a directory", doc.Source, doc.Fallback)
			}
		}
		a, ok := netip.AddrFromSlice(addr)
		if !ok {
			a = netip.AddrFrom4([4]byte{192, 168, 7, 1})
		}
		for _, doc := range docs {
			for _, d := range []DirectionPolicy{
				{Isolated: doc.IsolateIngress, Rules: doc.Ingress},
				{Isolated: doc.IsolateEgress, Rules: doc.Egress},
			} {
				v4, v6, err := d.Compile()
				if err != nil {
					if !errors.Is(err, ErrTooManyPortRanges) && !errors.Is(err, ErrTooManyEntries) {
						t.Fatalf("%s: Compile: %v", doc.Source, err)
					}
					continue
				}
				if !d.Isolated {
					continue
				}
				if got, want := lookup(v4, v6, a, proto, port), d.Allows(a, proto, port); got != want {
					t.Fatalf("%s: %s proto %d port %d: lookup %v, Allows %v\nrules %v", doc.Source, a, proto, port, got, want, d.Rules)
				}
				for _, r := range d.Rules {
					edge := r.CIDR.Masked().Addr()
					if got, want := lookup(v4, v6, edge, proto, port), d.Allows(edge, proto, port); got != want {
						t.Fatalf("%s: %s proto %d port %d: lookup %v, Allows %v\nrules %v", doc.Source, edge, proto, port, got, want, d.Rules)
					}
				}
			}
		}
	})
}
