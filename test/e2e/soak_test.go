package e2e

import (
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

var soakDuration = flag.Duration("soak.duration", 15*time.Second, "how long TestSoak runs (hack/soak.sh sets minutes)")

// TestSoak: connections through a service VIP between pods, as fast as a
// few paced dialers go, while `run` sweeps every second and the backend's policy
// changes every two seconds (each change a new generation, each one still
// allowing the client). No connection of the client may fail, one
// long-lived connection of it must carry data throughout, no connection of
// the stranger may succeed, and the sweeper's memory must stay flat.
// hack/soak.sh runs it for longer and prints the figures.
func TestSoak(t *testing.T) {
	c := newCluster(t, attachModes(t)[0])
	client, stranger, _ := c.vipScene(t)
	sweeper, logs := c.runSweeper(t, "--interval-min", "1s", "--interval-max", "1s", "--log-level", "debug")
	c.waitHealthy(t)
	traffic := startTraffic(t, client, stranger, 4)

	start := time.Now()
	var rssEarly uint64
	changes := 0
	for time.Since(start) < *soakDuration {
		time.Sleep(2 * time.Second)
		ports := []uint16{backendPort}
		if changes%2 == 0 {
			ports = append(ports, backendPort+1)
		}
		c.renamePolicy(t, "web", backendPolicy(client.ip, ports...))
		changes++
		if rssEarly == 0 && time.Since(start) > *soakDuration/4 {
			rssEarly = vmRSS(t, sweeper.Process.Pid)
		}
	}
	traffic.Stop()
	elapsed := time.Since(start)
	rssEnd := vmRSS(t, sweeper.Process.Pid)

	t.Logf("%v: %d client connections (%.0f/s), %d stranger attempts, %d policy changes, %d sweeps; sweeper RSS %d KiB after a quarter, %d KiB at the end; %d IPv4 conntrack entries",
		elapsed.Round(time.Second), traffic.Allowed.Load(), float64(traffic.Allowed.Load())/elapsed.Seconds(), traffic.StrangerTries.Load(), changes,
		strings.Count(logs.String(), `"msg":"pass"`), rssEarly, rssEnd, c.ctEntries(t))
	traffic.Check(t)
	// Flat: the heap may settle, not grow with the connections made.
	if rssEarly > 0 && rssEnd > rssEarly+rssEarly/2+8<<10 {
		t.Errorf("the sweeper grew from %d KiB to %d KiB", rssEarly, rssEnd)
	}
}

// vmRSS is a process's resident memory in KiB.
func vmRSS(t *testing.T, pid int) uint64 {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			n, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no VmRSS for %d", pid)
	return 0
}
