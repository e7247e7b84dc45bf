//go:build !race

package e2e

// raceDetector: see racebuild_on_test.go.
const raceDetector = false
