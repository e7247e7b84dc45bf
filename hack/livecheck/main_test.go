package main

import (
	"strings"
	"testing"
)

// TestCheckFindsTheSpill: the check reports the one program known to be
// compiled wrongly, at the temporary that outlives its array.
func TestCheckFindsTheSpill(t *testing.T) {
	found, err := check([]string{"./testdata/spill"})
	if err != nil {
		t.Fatal(err)
	}
	if len(found) == 0 {
		t.Fatal("nothing found in testdata/spill: the check no longer sees the pattern (or this Go compiles it right: see the program)")
	}
	for _, f := range found {
		if !strings.Contains(f, "&have[i]") || !strings.Contains(f, "main.f") {
			t.Errorf("unexpected finding: %s", f)
		}
	}
	t.Log(strings.Join(found, "\n"))
}
