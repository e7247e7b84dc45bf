package policymirror

import (
	"log/slog"
	"net/http"
	"sync"
	"time"

	"k8s.io/client-go/rest"
)

// WatchReachability makes cfg's client log when the API server stops
// answering and when it answers again. The reflector retries a watch that
// cannot connect without reporting it (connection refused is "retriable"),
// so without this an unreachable API would be silent: one line when it goes,
// one when it comes back, not one per retry.
func WatchReachability(cfg *rest.Config, log *slog.Logger) {
	prev := cfg.WrapTransport
	cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		if prev != nil {
			rt = prev(rt)
		}
		return &reachability{rt: rt, log: log}
	}
}

type reachability struct {
	rt  http.RoundTripper
	log *slog.Logger

	mu   sync.Mutex
	down time.Time // when requests started failing; zero while they succeed
}

func (r *reachability) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := r.rt.RoundTrip(req)
	if req.Context().Err() != nil {
		return resp, err // the caller gave up: says nothing about the server
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case err != nil && r.down.IsZero():
		r.down = time.Now()
		r.log.Warn("API server unreachable; enforcing the last policy and retrying", "error", err)
	case err == nil && !r.down.IsZero():
		r.log.Info("API server reachable again", "down_ms", time.Since(r.down).Milliseconds())
		r.down = time.Time{}
	}
	return resp, err
}
