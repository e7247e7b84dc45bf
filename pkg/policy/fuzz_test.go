package policy

import (
	"bytes"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// FuzzDocument: any bytes in the policy directory parse into documents,
// never a panic, and a broken one keeps no rule; what parses compiles for
// the datapath (or is refused with one of the limit errors), and every
// compiled lookup answers as the direct evaluation does. The same bytes
// read as ClusterPolicyEndpoints parse or fail with ErrInvalidDocument, and
// their tiers' compiled lookups answer as First does. The seeds are the
// example documents and the controller's objects; the corpus
// testdata/fuzz/FuzzDocument keeps what the fuzzer found.
func FuzzDocument(f *testing.F) {
	seeds, _ := filepath.Glob("testdata/*.*")
	controller, _ := filepath.Glob("testdata/controller/*.json")
	seeds = append(seeds, controller...)
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
		fuzzCluster(t, data, a, proto, port)
	})
}

func fuzzCluster(t *testing.T, data []byte, a netip.Addr, proto uint8, port uint16) {
	docs, err := ParseCluster(bytes.NewReader(data), "fuzz.yaml")
	if err != nil {
		if !errors.Is(err, ErrInvalidDocument) {
			t.Fatalf("ParseCluster: %v, not ErrInvalidDocument", err)
		}
		return
	}
	for _, doc := range docs {
		for _, rules := range [][]ClusterRule{doc.Ingress, doc.Egress} {
			tier := TierRules(slices.SortedStableFunc(slices.Values(rules), Before))
			v4, v6, err := tier.Compile()
			if err != nil {
				if !errors.Is(err, ErrTooManyPortRanges) && !errors.Is(err, ErrTooManyTierRules) {
					t.Fatalf("%s: Compile: %v", doc.Source, err)
				}
				continue
			}
			addrs := []netip.Addr{a}
			for _, r := range tier {
				addrs = append(addrs, r.CIDR.Masked().Addr())
			}
			for _, addr := range addrs {
				want, wantOK := tier.First(addr, proto, port)
				got, gotOK := tierLookup(v4, v6, addr, proto, port)
				if gotOK != wantOK || gotOK && (got.Action != want.Action || got.Priority != want.Priority) {
					t.Fatalf("%s: %s proto %d port %d: lookup %+v %v, First %+v %v", doc.Source, addr, proto, port, got, gotOK, want, wantOK)
				}
			}
		}
	}
}
