package sweep

import (
	"testing"
	"time"
)

func TestIntervalNext(t *testing.T) {
	iv := Interval{Min: 10 * time.Second, Max: 5 * time.Minute}
	for _, tc := range []struct {
		name             string
		last             time.Duration
		fill             float64
		deleted, scanned int
		want             time.Duration
	}{
		{"little to delete: grows by half", time.Minute, 0.1, 1, 100, 90 * time.Second},
		{"nothing scanned: grows", time.Minute, 0, 0, 0, 90 * time.Second},
		{"grows up to the maximum", 4 * time.Minute, 0.1, 0, 100, 5 * time.Minute},
		{"a moderate share: unchanged", time.Minute, 0.5, 10, 100, time.Minute},
		{"much deleted: halves", time.Minute, 0.5, 30, 100, 30 * time.Second},
		{"nearly full: halves even when little is deleted", time.Minute, 0.95, 0, 100, 30 * time.Second},
		{"shrinks down to the minimum", 15 * time.Second, 0.95, 90, 100, 10 * time.Second},
		{"a zero wait is raised to the minimum", 0, 0.5, 10, 100, 10 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := iv.Next(tc.last, tc.fill, tc.deleted, tc.scanned); got != tc.want {
				t.Errorf("Next = %v, want %v", got, tc.want)
			}
		})
	}
}
