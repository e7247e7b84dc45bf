package adopt

import (
	"context"
	"fmt"
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
	"github.com/podfence/podfence/pkg/pinroot"
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
// CNI_ARGS to a log and answers ADD with addErr, a CNI error code (105:
// the plugin found a DEL's tombstone; 7: the pod's veth is gone, say), or
// success for 0; it returns the bin directory and the log.
func scriptPlugin(t *testing.T, addErr int) (binDir, log string) {
	t.Helper()
	binDir = t.TempDir()
	log = filepath.Join(binDir, "calls")
	add := `echo '{"cniVersion": "1.0.0"}'`
	if addErr != 0 {
		add = fmt.Sprintf(`echo '{"cniVersion": "1.0.0", "code": %d, "msg": "refused"}'; exit 1`, addErr)
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
// the plugin refuse the ADD, which is no failure, nor is an ADD that fails
// because the pod was torn down (it does fail on a pod that is still
// ready); a runtime that does not answer keeps the pod's hooks.
func TestPassRacesDeletion(t *testing.T) {
	notFound := status.Error(codes.NotFound, "an error occurred when try to find sandbox")
	for _, tc := range []struct {
		name    string
		rt      fakeRuntime
		addErr  int      // the plugin's answer to ADD
		calls   []string // the plugin's commands, in order
		adopted int
		gone    string
		failed  bool
	}{
		{"still ready", fakeRuntime{state: runtimeapi.PodSandboxState_SANDBOX_READY}, 0, []string{"ADD"}, 1, "", false},
		{"removed meanwhile", fakeRuntime{after: notFound}, 0, []string{"ADD", "DEL"}, 0, goneUnknown, false},
		{"stopped meanwhile", fakeRuntime{state: runtimeapi.PodSandboxState_SANDBOX_NOTREADY}, 0, []string{"ADD", "DEL"}, 0, goneNotReady, false},
		{"its DEL ran first", fakeRuntime{state: runtimeapi.PodSandboxState_SANDBOX_NOTREADY}, 105, []string{"ADD"}, 0, goneBeforeAdd, false},
		{"torn down, ADD failed", fakeRuntime{after: notFound}, 7, []string{"ADD"}, 0, goneTornDown, false},
		{"ADD failed on a ready pod", fakeRuntime{state: runtimeapi.PodSandboxState_SANDBOX_READY}, 7, []string{"ADD"}, 0, "", true},
		{"runtime not answering", fakeRuntime{after: status.Error(codes.Unavailable, "connection refused")}, 0, []string{"ADD"}, 1, "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cri := serveRuntime(t, &tc.rt)
			binDir, log := scriptPlugin(t, tc.addErr)
			pinRoot := t.TempDir()
			list := `{"cniVersion": "1.0.0", "name": "aws-cni", "plugins": [{"type": "ptp"}, {"type": "podfence", "pinRoot": "` + pinRoot + `"}]}`
			r, err := Pass(context.Background(), Options{Runtime: cri, BinDir: binDir, Root: pinroot.At(pinRoot),
				Conflist: func() (string, []byte, error) { return "10-aws.conflist", []byte(list), nil }})
			if err != nil {
				t.Fatal(err)
			}
			if (len(r.Failed) > 0) != tc.failed {
				t.Errorf("failed: %v, want a failure %v", r.Failed, tc.failed)
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

// TestPassNeedsTheSweepersPinRoot: a conflist whose podfence entry pins
// elsewhere than the sweeper looks is refused before anything runs.
func TestPassNeedsTheSweepersPinRoot(t *testing.T) {
	cri := serveRuntime(t, &fakeRuntime{state: runtimeapi.PodSandboxState_SANDBOX_READY})
	binDir, log := scriptPlugin(t, 0)
	list := `{"cniVersion": "1.0.0", "name": "aws-cni", "plugins": [{"type": "podfence", "pinRoot": "/sys/fs/bpf/elsewhere"}]}`
	_, err := Pass(context.Background(), Options{Runtime: cri, BinDir: binDir, Root: pinroot.At(t.TempDir()),
		Conflist: func() (string, []byte, error) { return "10-aws.conflist", []byte(list), nil }})
	if err == nil || !strings.Contains(err.Error(), "/sys/fs/bpf/elsewhere") {
		t.Fatalf("Pass: %v, want an error naming the conflist's pin root", err)
	}
	if _, err := os.Stat(log); !os.IsNotExist(err) {
		t.Errorf("the plugin ran: %v", err)
	}
}
