package adopt

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/podfence/podfence/pkg/cniconf"
)

// fakeRuntime is a CRI runtime service of one ready sandbox, served over
// gRPC on a unix socket as containerd serves it. The listing's status
// (verbose) reports it ready; the later look (Ready) answers after.
type fakeRuntime struct {
	runtimeapi.UnimplementedRuntimeServiceServer
	after error // the status error of the second look, or nil
	state runtimeapi.PodSandboxState
}

const fakeSandbox = "0123456789abcdef"

func (f *fakeRuntime) ListPodSandbox(context.Context, *runtimeapi.ListPodSandboxRequest) (*runtimeapi.ListPodSandboxResponse, error) {
	return &runtimeapi.ListPodSandboxResponse{Items: []*runtimeapi.PodSandbox{{Id: fakeSandbox}}}, nil
}

func (f *fakeRuntime) PodSandboxStatus(_ context.Context, req *runtimeapi.PodSandboxStatusRequest) (*runtimeapi.PodSandboxStatusResponse, error) {
	st := &runtimeapi.PodSandboxStatus{Id: req.PodSandboxId, State: runtimeapi.PodSandboxState_SANDBOX_READY,
		Metadata: &runtimeapi.PodSandboxMetadata{Name: "web-1", Namespace: "default", Uid: "u-1"},
		Network:  &runtimeapi.PodSandboxNetworkStatus{Ip: "10.244.0.7"}}
	if req.Verbose {
		return &runtimeapi.PodSandboxStatusResponse{Status: st,
			Info: map[string]string{"info": `{"netNamespacePath": "/run/netns/cni-7"}`}}, nil
	}
	if f.after != nil {
		return nil, f.after
	}
	st.State = f.state
	return &runtimeapi.PodSandboxStatusResponse{Status: st}, nil
}

// serveRuntime serves f and returns a CRI client of it.
func serveRuntime(t *testing.T, f *fakeRuntime) *CRI {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "cri.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	runtimeapi.RegisterRuntimeServiceServer(srv, f)
	go srv.Serve(ln) //nolint:errcheck // ends with Stop
	t.Cleanup(srv.Stop)
	cri, err := DialCRI("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cri.Close() })
	return cri
}

// scriptPlugin installs a podfence "plugin" that appends its command and
// CNI_ARGS to a log and exits with code 105 on ADD when refuse is set, as
// the plugin does when a DEL's tombstone is there; it returns the bin
// directory and the log.
func scriptPlugin(t *testing.T, refuse bool) (binDir, log string) {
	t.Helper()
	binDir = t.TempDir()
	log = filepath.Join(binDir, "calls")
	add := `echo '{"cniVersion": "1.0.0"}'`
	if refuse {
		add = `echo '{"cniVersion": "1.0.0", "code": 105, "msg": "not adopted: DEL ran"}'; exit 1`
	}
	script := "#!/bin/sh\necho \"$CNI_COMMAND $CNI_ARGS\" >> " + log + "\n" +
		"cat >/dev/null\n" +
		"if [ \"$CNI_COMMAND\" = ADD ]; then " + add + "; fi\n"
	if err := os.WriteFile(filepath.Join(binDir, cniconf.PluginType), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return binDir, log
}

// TestPassRacesDeletion: a pass's ADD of a pod the runtime deletes
// meanwhile leaves no member. The runtime removing the sandbox (NotFound)
// or stopping it gets the ADD undone by a DEL; a DEL that ran first has
// the plugin refuse the ADD, which is no failure; a runtime that does not
// answer keeps the pod's hooks.
func TestPassRacesDeletion(t *testing.T) {
	for _, tc := range []struct {
		name    string
		rt      fakeRuntime
		refuse  bool
		calls   []string // the plugin's commands, in order
		adopted int
		gone    string
	}{
		{"still ready", fakeRuntime{state: runtimeapi.PodSandboxState_SANDBOX_READY}, false, []string{"ADD"}, 1, ""},
		{"removed meanwhile", fakeRuntime{after: status.Error(codes.NotFound, "an error occurred when try to find sandbox")}, false, []string{"ADD", "DEL"}, 0, goneUnknown},
		{"stopped meanwhile", fakeRuntime{state: runtimeapi.PodSandboxState_SANDBOX_NOTREADY}, false, []string{"ADD", "DEL"}, 0, goneNotReady},
		{"its DEL ran first", fakeRuntime{state: runtimeapi.PodSandboxState_SANDBOX_NOTREADY}, true, []string{"ADD"}, 0, goneBeforeAdd},
		{"runtime not answering", fakeRuntime{after: status.Error(codes.Unavailable, "connection refused")}, false, []string{"ADD"}, 1, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cri := serveRuntime(t, &tc.rt)
			binDir, log := scriptPlugin(t, tc.refuse)
			list := `{"cniVersion": "1.0.0", "name": "aws-cni", "plugins": [{"type": "ptp"}, {"type": "podfence", "pinRoot": "` + t.TempDir() + `"}]}`
			r, err := Pass(context.Background(), Options{Runtime: cri, BinDir: binDir,
				Conflist: func() (string, []byte, error) { return "10-aws.conflist", []byte(list), nil }})
			if err != nil {
				t.Fatal(err)
			}
			if len(r.Failed) > 0 {
				t.Errorf("failed: %v", r.Failed)
			}
			if r.Sandboxes != 1 || len(r.Adopted) != tc.adopted {
				t.Errorf("%d sandboxes, %d adopted; want 1, %d", r.Sandboxes, len(r.Adopted), tc.adopted)
			}
			var how string
			if len(r.Gone) == 1 {
				how = r.Gone[0].How
				if r.Gone[0].Pod != "default/web-1" || r.Gone[0].Sandbox != fakeSandbox {
					t.Errorf("gone %+v", r.Gone[0])
				}
			}
			if how != tc.gone || len(r.Gone) > 1 {
				t.Errorf("gone %+v, want %q", r.Gone, tc.gone)
			}
			out, err := os.ReadFile(log)
			if err != nil {
				t.Fatal(err)
			}
			var cmds []string
			for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
				cmd, args, _ := strings.Cut(line, " ")
				cmds = append(cmds, cmd)
				if !strings.Contains(args, cniconf.AdoptionArg+"=true") || !strings.Contains(args, "K8S_POD_NAME=web-1") {
					t.Errorf("%s's CNI_ARGS %q: not marked as an adoption's", cmd, args)
				}
			}
			if strings.Join(cmds, " ") != strings.Join(tc.calls, " ") {
				t.Errorf("the plugin ran %v, want %v", cmds, tc.calls)
			}
		})
	}
}
