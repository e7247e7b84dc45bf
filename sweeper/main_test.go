package main

import (
	"bytes"
	"flag"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestHoistFlags(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"ls", "ls"},
		{"--pin-root /x ls --json", "ls --pin-root /x --json"},
		{"--json --pin-root=/x sweep --grace 0s", "sweep --json --pin-root=/x --grace 0s"},
		{"--pin-root /x dump conntrack --pod web", "dump conntrack --pin-root /x --pod web"},
		{"-json why --pod web --to 10.0.0.1 80/tcp", "why -json --pod web --to 10.0.0.1 80/tcp"},
		{"--pin-root /x", "--pin-root /x"}, // no command: left for the usage message
		{"--help", "--help"},
	} {
		if got := strings.Join(hoistFlags(strings.Fields(c.in)), " "); got != c.want {
			t.Errorf("hoistFlags(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

func TestParseInterspersed(t *testing.T) {
	for _, c := range []struct {
		in         string
		positional []string
		json       bool
		grace      time.Duration
	}{
		{"--json 8080/tcp", []string{"8080/tcp"}, true, time.Second},
		{"8080/tcp --json", []string{"8080/tcp"}, true, time.Second},
		{"a --grace 0s b --json", []string{"a", "b"}, true, 0},
		{"a -- --json", []string{"a", "--json"}, false, time.Second},
	} {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		j := fs.Bool("json", false, "")
		g := fs.Duration("grace", time.Second, "")
		got, err := parseInterspersed(fs, strings.Fields(c.in))
		if err != nil || !slices.Equal(got, c.positional) || *j != c.json || *g != c.grace {
			t.Errorf("%q: positional %q json %v grace %v, %v; want %q %v %v", c.in, got, *j, *g, err, c.positional, c.json, c.grace)
		}
	}
}

// A flag the user set means what it says: global flags before the command
// are the command's, a size of 0 is refused rather than taken for the
// default, and a grace of 0 is accepted with a warning.
func TestFlagsMeanWhatTheySay(t *testing.T) {
	missing := t.TempDir() + "/none"
	for _, c := range []struct {
		args       string
		code       int
		wantStderr string
	}{
		{"--pin-root " + missing + " ls", 1, "pin root " + missing + " does not exist"},
		{"--pin-root=" + missing + " --json dump conntrack", 1, "pin root " + missing + " does not exist"},
		{"ls --ct-v4-entries 0 --pin-root " + missing, 2, "--ct-v4-entries 0: conntrack table size must be in"},
		{"--ct-v6-entries 0 sweep --pin-root " + missing, 2, "--ct-v6-entries 0"},
		{"sweep --grace 0s --pin-root " + missing, 1, "warning: --grace 0"},
		{"sweep --grace -1s --pin-root " + missing, 2, "--grace -1s"},
		{"--nonsense ls", 2, "flag provided but not defined: -nonsense"},
		{"adopt --cri-socket tcp://127.0.0.1:1 --pin-root " + missing, 2, "--cri-socket: CRI endpoint \"tcp://127.0.0.1:1\": want unix:///path"},
		{"adopt extra", 2, "unexpected arguments"},
	} {
		var stdout, stderr bytes.Buffer
		code := runMain(strings.Fields(c.args), &stdout, &stderr)
		if code != c.code || !strings.Contains(stderr.String(), c.wantStderr) {
			t.Errorf("%q: exit %d, stderr %q; want %d and %q", c.args, code, stderr.String(), c.code, c.wantStderr)
		}
	}
}
