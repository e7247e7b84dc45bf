package e2e

import (
	"fmt"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/podfence/podfence/test/netnsutil"
)

// liveTraffic is what TestSoak and TestUpgrade run through the service VIP
// of vipScene while they change the node: dialers of the client, every
// connection of which must succeed; one long-lived connection of it, which
// must carry a message every 50 ms throughout; and the stranger, which must
// never get through.
type liveTraffic struct {
	stop sync.Once
	done atomic.Bool
	wg   sync.WaitGroup

	Allowed, StrangerTries, LongMessages atomic.Int64

	mu       sync.Mutex
	failures []string
}

// dialerPace is the time between a dialer's connections: 4 dialers open
// at most 400 a second, which TIME_WAIT's 60 s keeps within the client's
// ports however long the traffic runs.
const dialerPace = 10 * time.Millisecond

// startTraffic starts dialers client dialers, the long-lived connection and
// the stranger; Stop ends them.
func startTraffic(t *testing.T, client, stranger *pod, dialers int) *liveTraffic {
	t.Helper()
	long, err := dialEcho(client.netns)
	if err != nil {
		t.Fatal(err)
	}
	l := &liveTraffic{}
	t.Cleanup(l.Stop)
	for w := range dialers {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			// Paced: each connection the client closes holds its port in
			// TIME_WAIT for 60 s, and the client has 28,232 ephemeral
			// ports; unpaced dialers ran out of them in 16 s.
			pace := time.NewTicker(dialerPace)
			defer pace.Stop()
			for i := 0; !l.done.Load(); i++ {
				<-pace.C
				conn, err := dialEcho(client.netns)
				if err == nil {
					err = conn.roundTrip(strconv.Itoa(i))
					conn.Close()
				}
				if err != nil {
					l.fail("client dialer %d, connection %d: %v", w, i, err)
					continue
				}
				l.Allowed.Add(1)
			}
		}()
	}
	l.wg.Add(2)
	go func() {
		defer l.wg.Done()
		for !l.done.Load() {
			l.StrangerTries.Add(1)
			if netnsutil.Dial(stranger.netns, netip.AddrPortFrom(serviceVIP.Addr(), servicePort), 100*time.Millisecond) == nil {
				l.fail("the stranger got through the VIP")
			}
		}
	}()
	go func() {
		defer l.wg.Done()
		defer long.Close()
		for i := 0; !l.done.Load(); i++ {
			if err := long.roundTrip("long " + strconv.Itoa(i)); err != nil {
				l.fail("the long-lived connection, message %d: %v", i, err)
				return
			}
			l.LongMessages.Add(1)
			time.Sleep(50 * time.Millisecond)
		}
	}()
	return l
}

func (l *liveTraffic) fail(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.failures) < 20 {
		l.failures = append(l.failures, time.Now().Format("15:04:05.000")+": "+fmt.Sprintf(format, args...))
	}
}

// Stop ends the traffic and waits for it; it can be called again.
func (l *liveTraffic) Stop() {
	l.stop.Do(func() {
		l.done.Store(true)
		l.wg.Wait()
	})
}

// Check stops the traffic and fails t for every failure it saw, or when
// no traffic ran.
func (l *liveTraffic) Check(t *testing.T) {
	t.Helper()
	l.Stop()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, f := range l.failures {
		t.Error(f)
	}
	if l.Allowed.Load() == 0 || l.StrangerTries.Load() == 0 || l.LongMessages.Load() == 0 {
		t.Errorf("no traffic ran: %d client connections, %d stranger attempts, %d long-lived messages",
			l.Allowed.Load(), l.StrangerTries.Load(), l.LongMessages.Load())
	}
}
