package adopt

import (
	"errors"
	"testing"

	"github.com/podfence/podfence/pkg/cniconf"
)

func TestNetnsPath(t *testing.T) {
	for _, tc := range []struct {
		name string
		info map[string]string
		want string // empty: an error
	}{
		{"containerd's default, under /var/run", map[string]string{"info": `{"netNamespacePath": "/var/run/netns/cni-1"}`}, "/run/netns/cni-1"},
		{"under the state directory", map[string]string{"info": `{"netNamespacePath": "/run/containerd/io.containerd.grpc.v1.cri/netns/cni-3"}`}, "/run/containerd/io.containerd.grpc.v1.cri/netns/cni-3"},
		{"only the OCI spec", map[string]string{"info": `{"runtimeSpec": {"linux": {"namespaces": [{"type": "pid"}, {"type": "network", "path": "/run/netns/cni-2"}]}}}`}, "/run/netns/cni-2"},
		{"no info", map[string]string{}, ""},
		{"not JSON", map[string]string{"info": `{`}, ""},
		{"no path", map[string]string{"info": `{"runtimeSpec": {"linux": {"namespaces": [{"type": "network"}]}}}`}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := netnsPath(tc.info)
			if tc.want == "" {
				if err == nil {
					t.Errorf("netnsPath = %q, want an error", got)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Errorf("netnsPath = %q, %v; want %q", got, err, tc.want)
			}
		})
	}
}

func TestPluginConf(t *testing.T) {
	for _, tc := range []struct {
		name, list string
		err        error
	}{
		{"chained", `{"cniVersion": "0.4.0", "name": "aws-cni", "plugins": [{"type": "ptp"}, {"type": "podfence", "pinRoot": "/p"}]}`, nil},
		{"not chained", `{"cniVersion": "0.4.0", "name": "aws-cni", "plugins": [{"type": "ptp"}]}`, ErrNotChained},
		{"malformed", `{"plugins": [`, cniconf.ErrMalformed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := pluginConf([]byte(tc.list))
			if !errors.Is(err, tc.err) {
				t.Fatalf("err = %v, want %v", err, tc.err)
			}
			if err == nil && (p.name != "aws-cni" || p.cniVersion != "0.4.0" || p.entry["pinRoot"] != "/p" || p.entry["type"] != nil) {
				t.Errorf("plugin = %+v", p)
			}
		})
	}
}
