package adopt

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// DefaultCRISocket is containerd's CRI endpoint, as the kubelet's
// containerRuntimeEndpoint names it.
const DefaultCRISocket = "unix:///run/containerd/containerd.sock"

// Sandbox is a pod sandbox the runtime reports ready, with what its ADD
// was given.
type Sandbox struct {
	ID        string // the sandbox (pause) container's ID: CNI_CONTAINERID
	Name      string
	Namespace string
	UID       string
	Netns     string // path of its network namespace: CNI_NETNS
	IPs       []netip.Addr
	Created   time.Time // zero if the runtime does not say
}

// ErrUnknownSandbox is wrapped by Runtime.Ready when the runtime does not
// know the sandbox: it was removed, so its pod is deleted.
var ErrUnknownSandbox = errors.New("the runtime does not know the sandbox")

// Runtime is what adoption asks the container runtime.
type Runtime interface {
	// Sandboxes lists the ready sandboxes that have a network namespace
	// of their own (host-network pods are left out).
	Sandboxes(ctx context.Context) ([]Sandbox, error)
	// Ready says whether the sandbox with id is still ready; an error
	// wrapping ErrUnknownSandbox when the runtime does not know it.
	Ready(ctx context.Context, id string) (bool, error)
}

// CRI is a Runtime over the Container Runtime Interface.
type CRI struct {
	conn *grpc.ClientConn
	rs   runtimeapi.RuntimeServiceClient
}

// DialCRI connects to a CRI endpoint (unix:///path). The connection is
// made lazily: a runtime that is down fails the first call, not this.
func DialCRI(endpoint string) (*CRI, error) {
	if !strings.HasPrefix(endpoint, "unix://") {
		return nil, fmt.Errorf("CRI endpoint %q: want unix:///path", endpoint)
	}
	conn, err := grpc.NewClient("unix://"+strings.TrimPrefix(endpoint, "unix://"),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("CRI endpoint %s: %w", endpoint, err)
	}
	return &CRI{conn: conn, rs: runtimeapi.NewRuntimeServiceClient(conn)}, nil
}

// Close closes the connection.
func (c *CRI) Close() error { return c.conn.Close() }

// Sandboxes implements Runtime.
func (c *CRI) Sandboxes(ctx context.Context) ([]Sandbox, error) {
	list, err := c.rs.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{Filter: &runtimeapi.PodSandboxFilter{
		State: &runtimeapi.PodSandboxStateValue{State: runtimeapi.PodSandboxState_SANDBOX_READY}}})
	if err != nil {
		return nil, fmt.Errorf("list pod sandboxes: %w", err)
	}
	var out []Sandbox
	var errs []error
	for _, s := range list.Items {
		sb, ok, err := c.status(ctx, s.Id)
		if status.Code(errors.Unwrap(err)) == codes.NotFound {
			continue // removed since the list: a deleted pod
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if ok {
			out = append(out, sb)
		}
	}
	return out, errors.Join(errs...)
}

// status reads one sandbox; ok is false for one adoption leaves alone:
// not ready any more, host network, no network namespace path.
func (c *CRI) status(ctx context.Context, id string) (Sandbox, bool, error) {
	st, err := c.rs.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: id, Verbose: true})
	if err != nil {
		return Sandbox{}, false, fmt.Errorf("sandbox %s: %w", id, err)
	}
	s := st.GetStatus()
	if s.GetState() != runtimeapi.PodSandboxState_SANDBOX_READY {
		return Sandbox{}, false, nil
	}
	if s.GetLinux().GetNamespaces().GetOptions().GetNetwork() == runtimeapi.NamespaceMode_NODE {
		return Sandbox{}, false, nil
	}
	sb := Sandbox{ID: id, Name: s.GetMetadata().GetName(), Namespace: s.GetMetadata().GetNamespace(), UID: s.GetMetadata().GetUid()}
	if ns := s.GetCreatedAt(); ns > 0 {
		sb.Created = time.Unix(0, ns)
	}
	sb.Netns, err = netnsPath(st.GetInfo())
	if err != nil {
		return Sandbox{}, false, fmt.Errorf("sandbox %s (%s/%s): %w", id, sb.Namespace, sb.Name, err)
	}
	for _, ip := range append([]*runtimeapi.PodIP{{Ip: s.GetNetwork().GetIp()}}, s.GetNetwork().GetAdditionalIps()...) {
		if a, err := netip.ParseAddr(ip.GetIp()); err == nil {
			sb.IPs = append(sb.IPs, a.Unmap())
		}
	}
	return sb, true, nil
}

// Ready implements Runtime.
func (c *CRI) Ready(ctx context.Context, id string) (bool, error) {
	st, err := c.rs.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: id})
	if status.Code(err) == codes.NotFound {
		return false, fmt.Errorf("sandbox %s: %w: %w", id, ErrUnknownSandbox, err)
	}
	if err != nil {
		return false, fmt.Errorf("sandbox %s: %w", id, err)
	}
	return st.GetStatus().GetState() == runtimeapi.PodSandboxState_SANDBOX_READY, nil
}

// netnsPath reads the sandbox's network namespace from the verbose
// status's "info": containerd reports it as netNamespacePath, and in the
// sandbox's OCI spec.
func netnsPath(info map[string]string) (string, error) {
	raw, ok := info["info"]
	if !ok {
		return "", errors.New("the runtime's verbose status has no info: cannot find the network namespace")
	}
	var v struct {
		NetNSPath   string `json:"netNamespacePath"`
		RuntimeSpec struct {
			Linux struct {
				Namespaces []struct{ Type, Path string } `json:"namespaces"`
			} `json:"linux"`
		} `json:"runtimeSpec"`
	}
	if err := json.Unmarshal([]byte(raw), &v); err != nil {
		return "", fmt.Errorf("the runtime's verbose status: %w", err)
	}
	if v.NetNSPath != "" {
		return hostRun(v.NetNSPath), nil
	}
	for _, ns := range v.RuntimeSpec.Linux.Namespaces {
		if ns.Type == "network" && ns.Path != "" {
			return hostRun(ns.Path), nil
		}
	}
	return "", errors.New("the runtime reports no network namespace path")
}

// hostRun names a path under /var/run by /run. containerd puts network
// namespaces under /var/run/netns unless told otherwise; on the host that
// is a symlink to /run, but the sweeper's container mounts only /run, and
// its /var/run holds the ServiceAccount's token.
func hostRun(path string) string {
	if rest, ok := strings.CutPrefix(path, "/var/run/"); ok {
		return "/run/" + rest
	}
	return path
}
