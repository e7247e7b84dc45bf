package attach

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/podfence/podfence/pkg/pinpath"
)

// Tests that need no root.

func TestParseMode(t *testing.T) {
	for _, tc := range []struct {
		in      string
		want    Mode
		wantErr bool
	}{
		{"", ModeAuto, false},
		{"auto", ModeAuto, false},
		{"tcx", ModeTCX, false},
		{"tc", ModeTC, false},
		{"TCX", "", true},
		{"xdp", "", true},
	} {
		got, err := ParseMode(tc.in)
		if (err != nil) != tc.wantErr || got != tc.want {
			t.Errorf("ParseMode(%q) = %q, %v; want %q, error %v", tc.in, got, err, tc.want, tc.wantErr)
		}
	}
}

func TestHookString(t *testing.T) {
	for h, want := range map[Hook]string{HookIngress: "ingress", HookEgress: "egress", 7: "hook(7)"} {
		if got := h.String(); got != want {
			t.Errorf("Hook(%d).String() = %q, want %q", h, got, want)
		}
	}
}

func TestResolveTC(t *testing.T) {
	got, err := Resolve(ModeTC)
	if err != nil || got != ModeTC {
		t.Fatalf("Resolve(tc) = %q, %v", got, err)
	}
	if _, err := Resolve("bogus"); err == nil {
		t.Fatal("Resolve(bogus) succeeded")
	}
}

func TestOptionsChecked(t *testing.T) {
	for _, tc := range []struct {
		name string
		o    Options
		want string
	}{
		{"no interface", Options{Hook: HookEgress, Mode: ModeTC}, "invalid interface index 0"},
		{"bad hook", Options{Ifindex: 3, Hook: 9, Mode: ModeTC}, "invalid hook(9)"},
		{"no program", Options{Ifindex: 3, Hook: HookEgress, Mode: ModeTC}, "no program"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Attach(tc.o)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Attach: %v, want error containing %q", err, tc.want)
			}
		})
	}
	err := Detach(Options{Ifindex: 3, Hook: HookIngress, Mode: ModeTCX})
	if err == nil || !strings.Contains(err.Error(), "no link pin") {
		t.Fatalf("Detach tcx without pin: %v", err)
	}
	if errors.Is(err, ErrTCXUnsupported) {
		t.Fatal("missing pin reported as missing tcx")
	}
	// Interface gone: only a link pin may be left, and none is.
	gone := Options{Hook: HookIngress, LinkPin: filepath.Join(t.TempDir(), pinpath.LinkIngress)}
	if err := Detach(gone); err != nil {
		t.Fatalf("Detach from a gone interface without a pin: %v", err)
	}
	gone.Hook = 9
	if err := Detach(gone); err == nil || !strings.Contains(err.Error(), "invalid interface index 0") {
		t.Fatalf("Detach with no interface and a bad hook: %v", err)
	}
}
