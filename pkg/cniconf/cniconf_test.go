package cniconf

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// testdata/10-aws.conflist is the shape of the AWS VPC CNI's conflist: the
// primary plugin, egress-cni for the other family, and portmap.
var vpcCNI = func() string {
	b, err := os.ReadFile("testdata/10-aws.conflist")
	if err != nil {
		panic(err)
	}
	return string(b)
}()

var conf = map[string]any{"pinRoot": "/sys/fs/bpf/podfence", "policyDir": "/etc/podfence/policies"}

// decoded is a conflist as generic JSON, to compare meaning, not bytes.
func decoded(t *testing.T, data []byte) map[string]any {
	t.Helper()
	var v map[string]any
	if err := json.Unmarshal(data, &v); err != nil {
		t.Fatalf("%v: %s", err, data)
	}
	return v
}

func plugins(t *testing.T, data []byte) []any { return decoded(t, data)["plugins"].([]any) }

func TestChainVPCCNI(t *testing.T) {
	out, changed, err := Chain([]byte(vpcCNI), conf)
	if err != nil || !changed {
		t.Fatalf("Chain: changed %v, %v", changed, err)
	}
	before, after := plugins(t, []byte(vpcCNI)), plugins(t, out)
	if len(after) != 4 {
		t.Fatalf("%d plugins after chaining, want 4: %s", len(after), out)
	}
	if !reflect.DeepEqual(after[:3], before) {
		t.Errorf("the other plugins changed:\n%s", out)
	}
	want := map[string]any{"type": "podfence", "pinRoot": conf["pinRoot"], "policyDir": conf["policyDir"]}
	if !reflect.DeepEqual(after[3], want) {
		t.Errorf("podfence entry %v, want %v", after[3], want)
	}
	b, a := decoded(t, []byte(vpcCNI)), decoded(t, out)
	delete(b, "plugins")
	delete(a, "plugins")
	if !reflect.DeepEqual(a, b) {
		t.Errorf("top-level fields changed: %v, want %v", a, b)
	}
	if !strings.HasPrefix(string(out), "{\n  \"cniVersion\": \"0.4.0\",\n  \"name\": \"aws-cni\",\n  \"disableCheck\": true,") {
		t.Errorf("top-level fields reordered:\n%s", out)
	}
	// Idempotent: a second run changes nothing, byte for byte.
	again, changed, err := Chain(out, conf)
	if err != nil || changed || string(again) != string(out) {
		t.Fatalf("second Chain: changed %v, %v", changed, err)
	}
	// Unchain gives back the same plugins and fields.
	back, changed, err := Unchain(out)
	if err != nil || !changed {
		t.Fatalf("Unchain: changed %v, %v", changed, err)
	}
	if !reflect.DeepEqual(decoded(t, back), decoded(t, []byte(vpcCNI))) {
		t.Errorf("Unchain did not restore the list:\n%s", back)
	}
	if _, changed, _ := Unchain(back); changed {
		t.Error("a second Unchain changed something")
	}
}

// podfence already in the list, but not last (an upgrade of the primary
// CNI appended its own plugin): moved to the end with its settings.
func TestChainMovesPodfenceLast(t *testing.T) {
	in := `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"ptp"},{"type":"podfence","attachMode":"tc"},{"type":"portmap"}]}`
	out, changed, err := Chain([]byte(in), conf)
	if err != nil || !changed {
		t.Fatalf("Chain: changed %v, %v", changed, err)
	}
	got := plugins(t, out)
	want := []any{map[string]any{"type": "ptp"}, map[string]any{"type": "portmap"}, map[string]any{"type": "podfence", "attachMode": "tc"}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("plugins %v, want %v", got, want)
	}
}

func TestMalformed(t *testing.T) {
	for _, tc := range []struct{ name, in string }{
		{"not JSON", `{"plugins": [`},
		{"not an object", `[{"type":"ptp"}]`},
		{"a single-plugin .conf", `{"cniVersion":"1.0.0","type":"ptp"}`},
		{"plugins not an array", `{"plugins": {"type":"ptp"}}`},
		{"a plugin without a type", `{"plugins": [{"name":"x"}]}`},
		{"a plugin that is not an object", `{"plugins": ["ptp"]}`},
		{"trailing data", `{"plugins": [{"type":"ptp"}]} {}`},
		{"two plugins fields", `{"plugins": [{"type":"ptp"}], "plugins": []}`},
		{"podfence twice", `{"plugins": [{"type":"podfence"},{"type":"podfence"}]}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, _, err := Chain([]byte(tc.in), conf); !errors.Is(err, ErrMalformed) {
				t.Errorf("Chain: %v, want ErrMalformed", err)
			}
			if tc.name == "podfence twice" {
				return // Unchain removes both
			}
			if _, _, err := Unchain([]byte(tc.in)); !errors.Is(err, ErrMalformed) {
				t.Errorf("Unchain: %v, want ErrMalformed", err)
			}
		})
	}
}

func TestFindConflist(t *testing.T) {
	dir := t.TempDir()
	for _, name := range []string{"99-other.conflist", "10-aws.conflist", "05-single.conf"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte("{}"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := FindConflist(dir)
	if err != nil || filepath.Base(got) != "10-aws.conflist" {
		t.Fatalf("FindConflist: %s, %v; want 10-aws.conflist", got, err)
	}
	if _, err := FindConflist(t.TempDir()); !errors.Is(err, ErrNoConflist) {
		t.Errorf("FindConflist of an empty directory: %v, want ErrNoConflist", err)
	}
}

// Entry gives back what Chain wrote, so that a list rewritten without
// podfence can be chained again with the settings it had.
func TestEntryRoundTrip(t *testing.T) {
	settings := map[string]any{"pinRoot": "/x", "enforcingMode": "strict", "ctV4Entries": json.Number("65536")}
	if got, err := Entry([]byte(vpcCNI)); err != nil || got != nil {
		t.Fatalf("Entry of a list without podfence = %v, %v; want nil, nil", got, err)
	}
	chained, _, err := Chain([]byte(vpcCNI), settings)
	if err != nil {
		t.Fatal(err)
	}
	got, err := Entry(chained)
	if err != nil || !reflect.DeepEqual(got, settings) {
		t.Fatalf("Entry = %v, %v; want %v", got, err, settings)
	}
	again, _, err := Chain([]byte(vpcCNI), got)
	if err != nil || string(again) != string(chained) {
		t.Errorf("chained again from Entry:\n%s\nwant\n%s (%v)", again, chained, err)
	}
	if _, err := Entry([]byte(`{"plugins": [{"type": "ptp"}, 1]}`)); !errors.Is(err, ErrMalformed) {
		t.Errorf("Entry of a malformed list: %v, want ErrMalformed", err)
	}
}
