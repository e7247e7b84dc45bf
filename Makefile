# podfence: see README.md. Targets that load eBPF programs need root.
GO ?= go
BIN := bin
PKGS := ./...

.PHONY: all build build-arm64 image generate test test-kernels fuzz soak bench demo lint check-generated clean cluster cluster-down conformance realnode-nftables realnode-services churn latency restarts podstart adoption race-prebuild

all: build

# bin/podfence (the CNI plugin) and bin/podfence-sweeper, static: a runtime
# execs the plugin for every pod, and a dynamically linked binary pays the
# loader on each call; the sweeper runs in a scratch image.
build:
	$(GO) build $(PKGS)
	CGO_ENABLED=0 $(GO) build -o $(BIN)/podfence ./plugins/podfence
	CGO_ENABLED=0 $(GO) build -o $(BIN)/podfence-sweeper ./sweeper

# EKS runs Graviton nodes: both binaries (and every package) for arm64.
build-arm64:
	CGO_ENABLED=0 GOARCH=arm64 $(GO) build $(PKGS)
	CGO_ENABLED=0 GOARCH=arm64 $(GO) build -o $(BIN)/linux-arm64/podfence ./plugins/podfence
	CGO_ENABLED=0 GOARCH=arm64 $(GO) build -o $(BIN)/linux-arm64/podfence-sweeper ./sweeper

# bin/podfence-image.tar: the container image of conf/podfence-sweeper.yaml
# (both static binaries in /usr/local/bin), written by a Go program, no
# daemon, as an OCI image-layout archive: `ctr images import` or
# `skopeo copy oci-archive:` take it from there.
IMAGE ?= ghcr.io/podfence/podfence:latest
image: build
	$(GO) run ./hack/image -o $(BIN)/podfence-image.tar -ref $(IMAGE) $(BIN)/podfence $(BIN)/podfence-sweeper

# Rebuild the bpf2go output from bpf/*.c (needs clang); the result is committed.
generate:
	$(GO) generate ./bpf/...

# Every test, the kernel-facing ones included (root, bpffs at /sys/fs/bpf).
# The API tests run a real kube-apiserver and etcd, the real-node tests a
# whole node: hack/k8s-tools.sh builds them once into ~/.cache/podfence,
# and PODFENCE_REQUIRE_K8S makes their absence a failure instead of a
# skip, in the race stage too (the policy mirror's tests run against a
# real API there). The real-node tests run alone, after the others: they
# check that the host is left as they found it, which other tests change
# meanwhile; verbose, for each test's time.
#
# The API tests need etcd and kube-apiserver only: they start once those
# are built, and the node's other tools (kubelet, e2e.test, CoreDNS, the
# controller...) build meanwhile at the lowest priority, in the CPU the
# tests leave while they wait on traffic and timeouts; the real-node stage
# waits for them. Likewise what the race stage builds is compiled at the
# lowest priority from the start (race-prebuild). Lowest
# for the whole machine: setsid gives it a session, and with the kernel's
# autogroup scheduling a session competes as one with every other,
# whatever its processes' nice value, so the session itself is niced
# (/proc/self/autogroup). Niced alone, race-prebuild took half the CPU
# from the e2e and real-node tests.
LOWEST = setsid sh -c 'echo 19 >/proc/self/autogroup 2>/dev/null; exec nice -n 19 "$$@"' lowest
test:
	$(GO) vet $(PKGS)
	@echo "test: etcd and kube-apiserver $$(date +%T)"
	$(LOWEST) $(MAKE) --no-print-directory race-prebuild >/dev/null 2>&1 & pre=$$!; \
	tools=$$(hack/k8s-tools.sh etcd kube-apiserver) || exit 1; \
	toolslog=$$(mktemp); \
	$(LOWEST) hack/k8s-tools.sh >/dev/null 2>"$$toolslog" & rest=$$!; \
	trap 'kill -- -$$pre -$$rest 2>/dev/null || true; rm -f "$$toolslog"' EXIT; \
	export PODFENCE_K8S_TOOLS=$$tools PODFENCE_REQUIRE_K8S=1; \
	echo "test: packages $$(date +%T)"; \
	$(GO) test -count=1 -timeout 30m $$($(GO) list $(PKGS) | grep -v /test/realnode) && \
		echo "test: the node's other tools $$(date +%T)" && \
		{ wait $$rest; rc=$$?; cat "$$toolslog" >&2; test $$rc = 0; } && \
		echo "test: real node $$(date +%T)" && \
		$(GO) test -count=1 -timeout 45m -v ./test/realnode/ && \
		echo "test: race detector $$(date +%T)" && \
		$(GO) test -count=1 -race ./pkg/... && \
		$(GO) test -count=1 -race -run 'TestApplyPolicyNeverMixesPolicies|TestOpenIdentifier|TestGlobalCreationRace' ./bpf/ && \
		$(GO) test -count=1 -race -run 'TestConcurrentAddDel' ./test/e2e/
	@echo "test: fuzzing $$(date +%T)"
	$(MAKE) fuzz FUZZTIME=10s
	@echo "test: done $$(date +%T)"

# Compiles what the race stage of make test runs, and discards it: the
# build cache keeps it. Killed (make test ends first), it still removes
# its output: dash runs an EXIT trap on a signal only if one is set.
race-prebuild:
	out=$$(mktemp -d) && trap 'rm -rf "$$out"' EXIT && trap 'exit 1' INT TERM && \
		CGO_ENABLED=1 $(GO) build -race -o "$$out/" ./plugins/podfence ./sweeper && \
		$(GO) test -race -c -o "$$out/" ./pkg/... ./bpf/ ./test/e2e/

# Each fuzz target for FUZZTIME (go test runs one per call). The committed
# corpora (testdata/fuzz/) also run as ordinary cases in every go test;
# what a longer run finds worth keeping, copy there from $$(go env GOCACHE)/fuzz.
FUZZTIME ?= 2m
FUZZ_TARGETS := ./pkg/policy:FuzzDocument ./plugins/podfence:FuzzConfig ./plugins/podfence:FuzzIdentify \
	./pkg/ctnetlink:FuzzMessages ./bpf:FuzzDatapath
fuzz:
	@hack/fuzz.sh $(FUZZTIME) $(FUZZ_TARGETS)

# The kernel-facing tests (./bpf, ./pkg/attach) in qemu guests on Debian's
# 5.10, 6.1 and 6.12 cloud kernels (hack/kernels/versions); fails if any
# kernel fails. Installs qemu; downloads are cached in ~/.cache/podfence/kernels.
test-kernels:
	hack/kernels/run.sh

bench:
	hack/bench.sh

# A real Kubernetes node on this machine (test/node), with podfence
# installed from its image and manifest; it keeps running, and prints a
# kubeconfig that works from here. make cluster-down removes all of it.
cluster: image
	tools=$$(hack/k8s-tools.sh) && cni=$$(hack/cni-plugins.sh) && \
		$(GO) run ./hack/cluster up -tools $$tools -cni-bin $$cni -image $(BIN)/podfence-image.tar

cluster-down:
	$(GO) run ./hack/cluster down

# The real-node tests' long forms (test/realnode), each on a node of its
# own (PODFENCE_NODE_STATE=DIR: on make cluster's instead); make test runs
# their short forms. conformance: every case of Kubernetes' NetworkPolicy
# suite; churn: 2,000 pods; latency: p50/p99 over 100 policy changes;
# restarts: five rounds of restarts under traffic; podstart: pod start to
# Ready with and without podfence in the chain.
REALNODE = tools=$$(hack/k8s-tools.sh) && PODFENCE_K8S_TOOLS=$$tools PODFENCE_REQUIRE_K8S=1 PODFENCE_PROXY_MODE=$(PROXY_MODE)
# kube-proxy's mode on those nodes: iptables (make test's), or nftables.
PROXY_MODE ?= iptables
conformance:
	$(REALNODE) PODFENCE_CONFORMANCE=full $(GO) test -count=1 -timeout 3h -v -run '^TestNetworkPolicySuite$$' ./test/realnode/

# The Service tests and the suite's CI subset with kube-proxy in nftables
# mode (make conformance PROXY_MODE=nftables runs the whole suite so).
realnode-nftables:
	$(MAKE) --no-print-directory PROXY_MODE=nftables realnode-services

realnode-services:
	$(REALNODE) $(GO) test -count=1 -timeout 30m -v -run '^(TestNetworkPolicySuite|TestServiceToHostNetworkBackend|TestClusterTierPrioritiesOnNode|TestServiceKeepsClientAddress)$$' ./test/realnode/

churn:
	$(REALNODE) PODFENCE_CHURN_ROUNDS=40 $(GO) test -count=1 -timeout 2h -v -run '^TestChurn$$' ./test/realnode/

latency:
	$(REALNODE) PODFENCE_LATENCY_CHANGES=100 $(GO) test -count=1 -timeout 1h -run '^$$' -bench '^Benchmark(Cluster)?PolicyLatency$$' -benchtime 1x ./test/realnode/

restarts:
	$(REALNODE) PODFENCE_RESTART_ROUNDS=5 $(GO) test -count=1 -timeout 1h -v -run '^TestRestartsUnderTraffic$$' ./test/realnode/

# Time to fence a full node (110 pods) podfence is installed on, tc and
# tcx; how long pods created while podfence was out of the chain stay open.
adoption:
	$(REALNODE) $(GO) test -count=1 -timeout 1h -run '^$$' -bench '^BenchmarkAdoption(Gap)?$$' -benchtime 1x ./test/realnode/

podstart:
	$(REALNODE) $(GO) test -count=1 -timeout 1h -run '^$$' -bench '^BenchmarkPodStart$$' -benchtime 1x ./test/realnode/

# TestSoak for SOAK_DURATION (10m); make test runs it for 15 s.
soak:
	hack/soak.sh

demo:
	hack/demo.sh

lint: check-generated build-arm64
	$(GO) vet $(PKGS)
	$(GO) run ./hack/livecheck $(PKGS)
	GOARCH=arm64 $(GO) vet $(PKGS)
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

# Regenerates in a scratch copy and compares, so a stale object fails CI.
check-generated:
	hack/check-generated.sh

clean:
	rm -rf $(BIN)
