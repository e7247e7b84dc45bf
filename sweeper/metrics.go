package main

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/podfence/podfence/pkg/liveness"
	"github.com/podfence/podfence/pkg/pinroot"
	"github.com/podfence/podfence/pkg/policymirror"
	"github.com/podfence/podfence/pkg/sweep"
)

// metrics are the run loop's Prometheus series.
type metrics struct {
	passDuration  prometheus.Histogram
	passErrors    prometheus.Counter
	scanned       prometheus.Counter
	entries       *prometheus.CounterVec // by decision and reason
	fill          *prometheus.GaugeVec   // by family
	events        prometheus.Counter
	eventsLost    prometheus.Counter
	eventDeletes  prometheus.Counter
	orphans       prometheus.Counter
	nodeAddrSyncs prometheus.Counter
	policyApplies prometheus.Counter
	policyErrors  prometheus.Counter
	policyValid   prometheus.Gauge
	// documentsInvalid and rulesNotEnforced: what the last load found.
	documentsInvalid prometheus.Gauge
	rulesNotEnforced prometheus.Gauge
	// programmingLatency: from the controller's write of a PolicyEndpoint
	// to its program on this node.
	programmingLatency prometheus.Histogram
	mirrorSynced       prometheus.Gauge
	mirrorObjects      prometheus.Gauge
	mirrorInvalid      prometheus.Gauge
	mirrorCluster      prometheus.Gauge
	mirrorWrites       prometheus.Counter
	mirrorErrors       prometheus.Counter
}

func newMetrics(reg prometheus.Registerer, pins *pinroot.Root) *metrics {
	m := &metrics{
		passDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "podfence_sweep_pass_duration_seconds", Help: "Duration of full reconciliation passes.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
		}),
		passErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "podfence_sweep_pass_errors_total", Help: "Passes that failed (nothing is deleted after a failure to read the kernel or the members)."}),
		scanned: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "podfence_sweep_entries_scanned_total", Help: "eBPF conntrack entries read by passes."}),
		entries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "podfence_sweep_entries_total", Help: "eBPF conntrack entries by what a pass decided and why."}, []string{"decision", "reason"}),
		fill: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "podfence_conntrack_fill_ratio", Help: "Occupancy of the eBPF conntrack maps at the last pass (0 to 1)."}, []string{"family"}),
		events: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "podfence_conntrack_destroy_events_total", Help: "Kernel conntrack destroy events followed."}),
		eventsLost: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "podfence_conntrack_destroy_events_lost_total", Help: "Times destroy events were lost (ENOBUFS); each triggers a full pass."}),
		eventDeletes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "podfence_conntrack_event_deletes_total", Help: "eBPF conntrack entries deleted on destroy events."}),
		orphans: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "podfence_orphans_removed_total", Help: "Members removed because their veth was gone."}),
		nodeAddrSyncs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "podfence_node_address_syncs_total", Help: "Times the node's addresses were written after they changed."}),
		policyApplies: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "podfence_policy_applies_total", Help: "Times the policy directory was loaded and programmed into every identifier."}),
		policyErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "podfence_policy_errors_total", Help: "Times the policy directory did not load, or an identifier could not be programmed."}),
		policyValid: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "podfence_policy_valid", Help: "1 when the policy directory could be read at the last change, 0 when identifiers keep their last good policy."}),
		documentsInvalid: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "podfence_policy_documents_invalid", Help: "Policy documents that do not parse, at the last load: each enforces its last good version, or its isolation alone, or nothing (ls names them)."}),
		programmingLatency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "podfence_policy_programming_latency_seconds",
			Help:    "From the network-policy controller's write of a PolicyEndpoint (its networking.k8s.aws/last-change-trigger-time) to its program into this node's maps.",
			Buckets: []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30},
		}),
		rulesNotEnforced: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "podfence_policy_rules_not_enforced", Help: "Rules left out at the last load (a domainName, a field podfence does not know inside a rule): each allows nothing (ls names them)."}),
		mirrorSynced: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "podfence_policy_source_synced", Help: "With --policy-source=kubernetes: 1 once the first full sync with the API is in the policy directory."}),
		mirrorObjects: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "podfence_policyendpoints_selected", Help: "PolicyEndpoints that select a pod on this node, at the last reconcile."}),
		mirrorInvalid: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "podfence_policyendpoints_invalid", Help: "PolicyEndpoints of this node that podfence cannot parse, at the last reconcile; each keeps its last good file."}),
		mirrorCluster: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "podfence_clusterpolicyendpoints_selected", Help: "ClusterPolicyEndpoints that select a pod on this node, at the last reconcile: mirrored into cluster/ and enforced."}),
		mirrorWrites: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "podfence_policyendpoint_file_writes_total", Help: "Policy files written or removed to follow the API."}),
		mirrorErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "podfence_policyendpoint_mirror_errors_total", Help: "Reconciles of the policy directory with the API that failed (retried after a second)."}),
	}
	reg.MustRegister(m.passDuration, m.passErrors, m.scanned, m.entries, m.fill, m.events, m.eventsLost,
		m.eventDeletes, m.orphans, m.nodeAddrSyncs, m.policyApplies, m.policyErrors, m.policyValid,
		m.documentsInvalid, m.rulesNotEnforced, m.programmingLatency,
		m.mirrorSynced, m.mirrorObjects, m.mirrorInvalid, m.mirrorCluster, m.mirrorWrites, m.mirrorErrors,
		&packetCollector{pins: pins})
	// Every reason appears from the start, at 0.
	for r := range liveness.DeletedDead + 1 {
		m.entries.WithLabelValues(decision(r), r.String())
	}
	return m
}

func decision(r liveness.Reason) string {
	if r.Delete() {
		return "deleted"
	}
	return "kept"
}

func (m *metrics) pass(rep sweep.Report, err error) {
	if err != nil {
		m.passErrors.Inc()
	}
	m.passDuration.Observe(rep.Duration.Seconds())
	m.scanned.Add(float64(rep.Scanned))
	for r, n := range rep.Count {
		m.entries.WithLabelValues(decision(liveness.Reason(r)), liveness.Reason(r).String()).Add(float64(n))
	}
	m.fill.WithLabelValues("ipv4").Set(rep.Fill[0])
	m.fill.WithLabelValues("ipv6").Set(rep.Fill[1])
	m.orphans.Add(float64(len(rep.Orphans)))
}

// packetCollector reports the datapath's per-identifier counters at
// scrape time: they are the kernel's, not the sweeper's.
type packetCollector struct{ pins *pinroot.Root }

var packetsDesc = prometheus.NewDesc("podfence_identifier_packets_total",
	"Packets the identifier's programs judged, by verdict.", []string{"identifier", "verdict"}, nil)

func (c *packetCollector) Describe(ch chan<- *prometheus.Desc) { ch <- packetsDesc }

func (c *packetCollector) Collect(ch chan<- prometheus.Metric) {
	counts, err := readCounters(c.pins)
	if err != nil {
		return
	}
	for _, c := range counts {
		ch <- prometheus.MustNewConstMetric(packetsDesc, prometheus.CounterValue, float64(c.Allowed), string(c.ID), "allowed")
		ch <- prometheus.MustNewConstMetric(packetsDesc, prometheus.CounterValue, float64(c.Denied), string(c.ID), "denied")
	}
}

func (m *metrics) mirror(rep policymirror.Report, err error) {
	m.mirrorWrites.Add(float64(rep.Written + rep.Removed))
	if err != nil {
		m.mirrorErrors.Inc()
		return // the counts of a failed reconcile describe nothing
	}
	m.mirrorObjects.Set(float64(rep.Selected))
	m.mirrorInvalid.Set(float64(rep.Invalid))
	m.mirrorCluster.Set(float64(rep.ClusterSelected))
}

// registerDroppedEvents reports the deny events the datapath did not write
// (rate limit, full ring buffer), read from the node's maps at each scrape.
func registerDroppedEvents(reg prometheus.Registerer, pins *pinroot.Root) {
	reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "podfence_deny_events_dropped_total",
		Help: "Deny events the datapath did not write: over its rate limit (about one per millisecond per CPU, bursts of 64) or with the ring buffer full.",
	}, func() float64 {
		g, err := pins.Global()
		if err != nil {
			return 0
		}
		n, _ := g.DroppedEvents()
		return float64(n)
	}))
}
