package node

import (
	"context"
	_ "embed"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// apiServer starts etcd and the API server.
func (s *supervisor) apiServer() error {
	if _, err := s.start("etcd", s.tool("etcd"),
		"--data-dir="+s.path("etcd"),
		"--listen-client-urls=http://127.0.0.1:2379",
		"--advertise-client-urls=http://127.0.0.1:2379",
		"--listen-peer-urls=http://127.0.0.1:2380",
		"--initial-advertise-peer-urls=http://127.0.0.1:2380",
		"--initial-cluster=default=http://127.0.0.1:2380",
		// A test node lives for minutes: durability buys nothing.
		"--unsafe-no-fsync",
		"--log-level=warn",
	); err != nil {
		return err
	}
	if _, err := s.start("kube-apiserver", s.tool("kube-apiserver"),
		"--etcd-servers=http://127.0.0.1:2379",
		"--bind-address=0.0.0.0",
		"--advertise-address="+NodeIP.String(),
		"--secure-port="+strconv.Itoa(apiServerPort),
		"--tls-cert-file="+s.pki.serverCert,
		"--tls-private-key-file="+s.pki.serverKey,
		"--token-auth-file="+s.pki.tokens,
		"--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc."+ClusterDomain,
		"--service-account-key-file="+s.pki.saKey,
		"--service-account-signing-key-file="+s.pki.saKey,
		"--service-cluster-ip-range="+ServiceCIDR.String(),
		"--allow-privileged=true",
		// exec, logs and port-forward reach the kubelet by the node's
		// address, not by a hostname this namespace cannot resolve.
		"--kubelet-preferred-address-types=InternalIP",
		"--cert-dir="+s.path("pki", "apiserver"),
		"-v=0",
	); err != nil {
		return err
	}
	ctx := context.Background()
	return s.waitFor("kube-apiserver", 90*time.Second, func() error {
		_, err := s.kubectl(ctx, "get", "--raw", "/readyz")
		return err
	})
}

// controllers starts the controller manager and the scheduler.
func (s *supervisor) controllers() error {
	if _, err := s.start("kube-controller-manager", s.tool("kube-controller-manager"),
		"--kubeconfig="+s.inner,
		// Pod addresses come from host-local, as the VPC CNI's from ENIs.
		"--controllers=*,-node-ipam-controller",
		"--leader-elect=false",
		"--service-account-private-key-file="+s.pki.saKey,
		"--root-ca-file="+s.pki.caFile(),
		"--flex-volume-plugin-dir="+s.path("flex-volume"),
		"--bind-address=127.0.0.1",
		"-v=0",
	); err != nil {
		return err
	}
	_, err := s.start("kube-scheduler", s.tool("kube-scheduler"),
		"--kubeconfig="+s.inner,
		"--leader-elect=false",
		"--bind-address=127.0.0.1",
		"-v=0",
	)
	return err
}

// containerdConfig is Debian's containerd 1.6 for the kubelet: the CRI
// plugin with runc, the node's pause image, CNI from /etc/cni/net.d and
// /opt/cni/bin, pods' network namespaces where it puts them by default.
const containerdConfig = `version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  # This VM lacks CAP_SYS_RESOURCE: runc cannot raise oom_score_adj.
  restrict_oom_score_adj = true
  # Pod network namespaces where containerd puts them by default, as on
  # an EKS node: /var/run/netns, which adoption reads as /run/netns. The
  # node's /run is an overlay: the host's /run/netns is not touched.
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/opt/cni/bin"
    conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
`

// containerd writes the primary CNI's conflist and plugins (ptp and
// host-local in the VPC CNI's shape), and starts containerd.
func (s *supervisor) containerd() error {
	for _, d := range []string{"/etc/cni/net.d", "/opt/cni/bin", "/etc/podfence/policies"} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	for _, p := range []string{"ptp", "host-local", "portmap", "loopback"} {
		b, err := os.ReadFile(filepath.Join(s.opts.CNIBin, p))
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join("/opt/cni/bin", p), b, 0o755); err != nil {
			return err
		}
	}
	if err := os.WriteFile("/etc/cni/net.d/10-aws.conflist", []byte(PrimaryConflist()), 0o644); err != nil {
		return err
	}
	conf := s.path("containerd.toml")
	if err := os.WriteFile(conf, []byte(fmt.Sprintf(containerdConfig, PauseImage)), 0o644); err != nil {
		return err
	}
	if _, err := s.start("containerd", "containerd", "--config", conf); err != nil {
		return err
	}
	return s.waitFor("containerd", 30*time.Second, func() error {
		_, err := s.run(context.Background(), "ctr", "--address", "/run/containerd/containerd.sock", "version")
		return err
	})
}

// PrimaryConflist is the node's conflist before podfence's install-cni
// chains podfence into it: the VPC CNI's shape (10-aws.conflist, its
// first plugin named aws-cni, then portmap), with ptp and host-local
// giving each pod a routed host-side veth as aws-cni does.
func PrimaryConflist() string {
	return fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "aws-cni",
  "disableCheck": true,
  "plugins": [
    {
      "name": "aws-cni",
      "type": "ptp",
      "mtu": 1500,
      "ipMasq": false,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": %q}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": "/var/lib/cni/networks"
      }
    },
    {
      "type": "portmap",
      "capabilities": {"portMappings": true},
      "snat": true
    }
  ]
}
`, PodCIDR.String())
}

// images imports the image archives into containerd's k8s.io namespace.
func (s *supervisor) images() error {
	archives, err := filepath.Glob(s.path("images", "*.tar"))
	if err != nil {
		return err
	}
	for _, a := range append(archives, s.opts.Images...) {
		if _, err := s.run(context.Background(), "ctr", "--address", "/run/containerd/containerd.sock",
			"-n", "k8s.io", "images", "import", "--no-unpack", a); err != nil {
			return err
		}
	}
	return nil
}

// kubeletConfig is what this machine needs of the kubelet: cgroup v1
// allowed, the cgroupfs driver below the node's cgroup root, swap
// tolerated, and no eviction for a disk that is far from full.
const kubeletConfig = `apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
failSwapOn: false
cgroupDriver: cgroupfs
cgroupRoot: %q
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
clusterDNS: [%q]
clusterDomain: %q
resolvConf: %q
volumePluginDir: %q
evictionHard: {memory.available: "50Mi", nodefs.available: "1%%", imagefs.available: "1%%", nodefs.inodesFree: "1%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
maxPods: 250
syncFrequency: 10s
fileCheckFrequency: 10s
nodeStatusUpdateFrequency: 5s
`

// kubeProxyConfig leaves the machine-wide conntrack table size alone and
// knows the pod range, so that pod-to-Service traffic is not masqueraded.
const kubeProxyConfig = `apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: %q}
hostnameOverride: %q
clusterCIDR: %q
mode: %s
conntrack: {maxPerCore: 0, min: 0}
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
`

// nodeAgents starts the kubelet and kube-proxy and waits until the node is
// Ready.
func (s *supervisor) nodeAgents() error {
	kc := s.path("kubelet.yaml")
	if err := os.WriteFile(kc, []byte(fmt.Sprintf(kubeletConfig, s.cgroupRoot, DNSServiceIP, ClusterDomain,
		s.path("resolv.conf"), s.path("volume-plugins"))), 0o644); err != nil {
		return err
	}
	if _, err := s.start("kubelet", s.tool("kubelet"),
		"--config="+kc,
		"--kubeconfig="+s.inner,
		"--root-dir=/var/lib/kubelet",
		"--hostname-override="+NodeName,
		"--node-ip="+NodeIP.String(),
		"-v=1",
	); err != nil {
		return err
	}
	pc := s.path("kube-proxy.yaml")
	if err := os.WriteFile(pc, []byte(fmt.Sprintf(kubeProxyConfig, s.inner, NodeName, ClusterCIDR, s.opts.ProxyMode)), 0o644); err != nil {
		return err
	}
	if _, err := s.start("kube-proxy", s.tool("kube-proxy"), "--config="+pc, "-v=0"); err != nil {
		return err
	}
	ctx := context.Background()
	return s.waitFor("node Ready", 90*time.Second, func() error {
		out, err := s.kubectl(ctx, "get", "node", NodeName, "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
		if err != nil {
			return err
		}
		if strings.TrimSpace(string(out)) != "True" {
			return fmt.Errorf("Ready is %q", out)
		}
		return nil
	})
}

// policyController runs the upstream network-policy controller, which
// installs its CRDs and turns NetworkPolicies into PolicyEndpoints.
func (s *supervisor) policyController() error {
	if _, err := s.start("network-policy-controller", s.tool("network-policy-controller"),
		"--kubeconfig="+s.inner,
		"--enable-leader-election=false",
		"--enable-configmap-check=false",
		"--metrics-bind-addr=127.0.0.1:8082",
		"--health-probe-bind-addr=127.0.0.1:8083",
	); err != nil {
		return err
	}
	ctx := context.Background()
	// Served, not only created: the controller manager's garbage collector
	// reads the resources it watches from discovery when it starts and then
	// every 30 s, and it is what deletes a PolicyEndpoint once its
	// NetworkPolicy is gone. Started before it saw the CRD, the node's
	// first NetworkPolicy delete reached the pods up to 30 s late.
	return s.waitFor("PolicyEndpoints served", 60*time.Second, func() error {
		_, err := s.kubectl(ctx, "get", "policyendpoints.networking.k8s.aws", "--all-namespaces")
		return err
	})
}

//go:embed coredns.yaml
var coreDNSManifest string

// coreDNS deploys CoreDNS behind the kube-dns Service and waits until it
// answers.
func (s *supervisor) coreDNS() error {
	m := strings.NewReplacer("$IMAGE", CoreDNSImage, "$DNS_IP", DNSServiceIP.String(), "$DOMAIN", ClusterDomain).Replace(coreDNSManifest)
	f := s.path("coredns.yaml")
	if err := os.WriteFile(f, []byte(m), 0o644); err != nil {
		return err
	}
	ctx := context.Background()
	if _, err := s.kubectl(ctx, "apply", "-f", f); err != nil {
		return err
	}
	return s.waitFor("CoreDNS", 120*time.Second, func() error {
		out, err := s.kubectl(ctx, "-n", "kube-system", "get", "deploy", "coredns", "-o", "jsonpath={.status.readyReplicas}")
		if err != nil {
			return err
		}
		if strings.TrimSpace(string(out)) != "1" {
			return fmt.Errorf("%q replicas ready", out)
		}
		// And it resolves, through the Service, from this namespace.
		r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, net.JoinHostPort(DNSServiceIP.String(), "53"))
		}}
		c, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, err = r.LookupHost(c, "kubernetes.default.svc."+ClusterDomain)
		return err
	})
}
