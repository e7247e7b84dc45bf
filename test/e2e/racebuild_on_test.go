//go:build race

package e2e

// raceDetector is true in a test binary built with -race; TestMain then
// builds the plugin with it too, so that the plugin's own code is checked,
// not only the harness that runs it (a race report makes the plugin exit 66
// and the call fail).
const raceDetector = true
