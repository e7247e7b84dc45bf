package main

import (
	"errors"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/podfence/podfence/pkg/podid"
)

// FuzzConfig: whatever a runtime writes on stdin, parseConfig returns a
// configuration or a CNI error of code 7 (invalid network config), never a
// panic; an accepted configuration has the defaults filled in and a mode
// and paths the plugin can act on.
func FuzzConfig(f *testing.F) {
	f.Add(withPrev(), true)
	f.Add(conf(`"pinRoot": "/sys/fs/bpf/x"`, `"enforcingMode": "strict"`, `"ctV4Entries": 4096`), false)
	f.Add([]byte(`{"cniVersion": "0.4.0", "prevResult": {"ips": []}}`), true)
	f.Add([]byte(`[]`), false)
	f.Fuzz(func(t *testing.T, stdin []byte, needPrev bool) {
		c, err := parseConfig(stdin, needPrev)
		if err != nil {
			var cniErr *types.Error
			if !errors.As(err, &cniErr) || cniErr.Code != types.ErrInvalidNetworkConfig {
				t.Fatalf("parseConfig error %v (%T), want a CNI error of code %d", err, err, types.ErrInvalidNetworkConfig)
			}
			return
		}
		if c.PinRoot == "" || c.PolicyDir == "" || c.mode == "" {
			t.Fatalf("accepted a configuration without defaults: %+v", c)
		}
	})
}

// FuzzIdentify: CNI_ARGS and the container ID come from the runtime; a pod
// identifier is derived from them or the call fails with CNI error 4, and a
// derived identifier is always a safe bpffs path component.
func FuzzIdentify(f *testing.F) {
	f.Add("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-7f65cc6544-9j58r", "ctr1")
	f.Add("K8S_POD_NAME=../../etc;K8S_POD_NAMESPACE=x", "c")
	f.Add("", "0123456789abcdef")
	f.Add("K8S_POD_NAME=a=b;;", "")
	f.Fuzz(func(t *testing.T, cniArgs, containerID string) {
		id, _, err := identify(&skel.CmdArgs{Args: cniArgs, ContainerID: containerID})
		if err != nil {
			var cniErr *types.Error
			if !errors.As(err, &cniErr) || cniErr.Code != types.ErrInvalidEnvironmentVariables {
				t.Fatalf("identify error %v, want a CNI error of code %d", err, types.ErrInvalidEnvironmentVariables)
			}
			return
		}
		s := string(id)
		if s == "" || s == "." || s == ".." || strings.ContainsAny(s, "/\x00") || len(s) > 255 {
			t.Fatalf("identifier %q is not a safe path component", s)
		}
		if !podid.Valid(s) {
			t.Fatalf("identifier %q is not Valid", s)
		}
	})
}
