package main

import (
	"fmt"
	"log/slog"

	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/podfence/podfence/pkg/nodeaddr"
	"github.com/podfence/podfence/pkg/policymirror"
)

// Policy sources of `run --policy-source`.
const (
	sourceFiles      = "files"
	sourceKubernetes = "kubernetes"
)

// apiConfig is the API client configuration of --kubeconfig: empty means
// the in-cluster configuration (the pod's ServiceAccount token).
func apiConfig(kubeconfig string) (*rest.Config, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig == "" {
		cfg, err = rest.InClusterConfig()
	} else {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	}
	if err != nil {
		return nil, fmt.Errorf("--policy-source=kubernetes: API client configuration: %w", err)
	}
	cfg.UserAgent = "podfence-sweeper"
	return cfg, nil
}

// newMirror builds the Kubernetes policy source: PolicyEndpoints of this
// node, mirrored into policyDir.
func newMirror(cfg *rest.Config, policyDir string, m *metrics, log *slog.Logger) (*policymirror.Mirror, error) {
	log = log.With("source", sourceKubernetes)
	policymirror.WatchReachability(cfg, log)
	client, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("--policy-source=kubernetes: %w", err)
	}
	cluster := 0 // ClusterPolicyEndpoints of this node at the last reconcile
	return policymirror.New(client, policymirror.Options{
		Dir:       policyDir,
		NodeAddrs: nodeaddr.List,
		Log:       log,
		OnReconcile: func(rep policymirror.Report, err error) {
			m.mirror(rep, err)
			if err == nil && rep.ClusterSelected != cluster {
				cluster = rep.ClusterSelected
				logClusterPolicies(log, cluster)
			}
		},
	})
}

// logClusterPolicies says, each time their number changes, how many
// cluster policies select pods here: an operator reading the log sees that
// the node follows the admin's tiers, and when they stop applying.
func logClusterPolicies(log *slog.Logger, n int) {
	if n == 0 {
		log.Info("no ClusterPolicyEndpoint selects a pod on this node any more")
		return
	}
	log.Info("ClusterPolicyEndpoints select pods on this node: their Admin and Baseline rules are enforced from the policy directory's cluster/",
		"selected", n)
}
