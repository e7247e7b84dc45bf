package e2e

import (
	"flag"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/podfence/podfence/test/netnsutil"
)

var soakDuration = flag.Duration("soak.duration", 15*time.Second, "how long TestSoak runs (hack/soak.sh sets minutes)")

// TestSoak: connections through a service VIP between pods, as fast as a
// few dialers go, while `run` sweeps every second and the backend's policy
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
	long, err := dialEcho(client.netns)
	if err != nil {
		t.Fatal(err)
	}
	defer long.Close()

	var (
		stop                 atomic.Bool
		wg                   sync.WaitGroup
		allowed, strangerTry atomic.Int64
		mu                   sync.Mutex
		failures             []string
	)
	fail := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		if len(failures) < 20 {
			failures = append(failures, fmt.Sprintf("%s: ", time.Now().Format("15:04:05.000"))+fmt.Sprintf(format, args...))
		}
	}
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; !stop.Load(); i++ {
				conn, err := dialEcho(client.netns)
				if err == nil {
					err = conn.roundTrip(strconv.Itoa(i))
					conn.Close()
				}
				if err != nil {
					fail("client dialer %d, connection %d: %v", w, i, err)
					continue
				}
				allowed.Add(1)
			}
		}()
	}
	wg.Add(2)
	go func() {
		defer wg.Done()
		for !stop.Load() {
			strangerTry.Add(1)
			if netnsutil.Dial(stranger.netns, netip.AddrPortFrom(serviceVIP.Addr(), servicePort), 100*time.Millisecond) == nil {
				fail("the stranger got through the VIP")
			}
		}
	}()
	go func() {
		defer wg.Done()
		for i := 0; !stop.Load(); i++ {
			if err := long.roundTrip("long " + strconv.Itoa(i)); err != nil {
				fail("the long-lived connection, message %d: %v", i, err)
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
	}()

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
	stop.Store(true)
	wg.Wait()
	elapsed := time.Since(start)
	rssEnd := vmRSS(t, sweeper.Process.Pid)

	t.Logf("%v: %d client connections (%.0f/s), %d stranger attempts, %d policy changes, %d sweeps; sweeper RSS %d KiB after a quarter, %d KiB at the end; %d IPv4 conntrack entries",
		elapsed.Round(time.Second), allowed.Load(), float64(allowed.Load())/elapsed.Seconds(), strangerTry.Load(), changes,
		strings.Count(logs.String(), `"msg":"pass"`), rssEarly, rssEnd, c.ctEntries(t))
	for _, f := range failures {
		t.Error(f)
	}
	if allowed.Load() == 0 || strangerTry.Load() == 0 {
		t.Error("no traffic ran")
	}
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
