package main

import (
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/podfence/podfence/pkg/podid"
)

func TestParseK8sArgs(t *testing.T) {
	for _, c := range []struct {
		in              string
		name, namespace string
	}{
		{"", "", ""},
		{"IgnoreUnknown=1", "", ""},
		{"K8S_POD_NAME=web-7f65cc6544-9j58r;K8S_POD_NAMESPACE=default", "web-7f65cc6544-9j58r", "default"},
		// What kubelet's runtimes pass: more keys than podfence reads.
		{"IgnoreUnknown=1;K8S_POD_NAMESPACE=prod;K8S_POD_NAME=db-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=1-2-3", "db-0", "prod"},
		{"K8S_POD_NAME=web", "web", ""},
		{"K8S_POD_NAMESPACE=default", "", "default"},
		{"K8S_POD_NAME=", "", ""},
		// The value is everything after the first '='; podid judges it.
		{"K8S_POD_NAME=a=b;K8S_POD_NAMESPACE=x", "a=b", "x"},
		// The last occurrence wins.
		{"K8S_POD_NAME=a;K8S_POD_NAME=b", "b", ""},
		// Keys are case-sensitive, as in the spec.
		{"k8s_pod_name=web", "", ""},
	} {
		got, err := parseK8sArgs(c.in)
		if err != nil {
			t.Errorf("parseK8sArgs(%q): %v", c.in, err)
			continue
		}
		if got.name != c.name || got.namespace != c.namespace || got.adoption {
			t.Errorf("parseK8sArgs(%q) = %q/%q adoption %v, want %q/%q", c.in, got.namespace, got.name, got.adoption, c.namespace, c.name)
		}
	}
}

// TestParseAdoptionArg: only "true" marks an adoption's ADD.
func TestParseAdoptionArg(t *testing.T) {
	for in, want := range map[string]bool{
		"IgnoreUnknown=1;K8S_POD_NAME=a;PODFENCE_ADOPTION=true": true,
		"PODFENCE_ADOPTION=false":                               false,
		"PODFENCE_ADOPTION=":                                    false,
		"PODFENCE_ADOPTION=1":                                   false,
		"podfence_adoption=true":                                false,
	} {
		got, err := parseK8sArgs(in)
		if err != nil || got.adoption != want {
			t.Errorf("parseK8sArgs(%q): adoption %v, %v; want %v", in, got.adoption, err, want)
		}
	}
}

func TestParseK8sArgsMalformed(t *testing.T) {
	for _, c := range []struct{ in, pair string }{
		{"K8S_POD_NAME", `"K8S_POD_NAME"`},
		{"K8S_POD_NAME=web;K8S_POD_NAMESPACE", `"K8S_POD_NAMESPACE"`},
		{"K8S_POD_NAME=web;", `""`},
		{";K8S_POD_NAME=web", `""`},
		{"K8S_POD_NAME=web;;K8S_POD_NAMESPACE=x", `""`},
	} {
		_, err := parseK8sArgs(c.in)
		if err == nil || !strings.Contains(err.Error(), c.pair) || !strings.Contains(err.Error(), "KEY=VALUE") {
			t.Errorf("parseK8sArgs(%q): got %v, want an error naming %s as not KEY=VALUE", c.in, err, c.pair)
		}
	}
}

func TestIdentify(t *testing.T) {
	for _, c := range []struct {
		args, container string
		want            podid.ID
	}{
		{"K8S_POD_NAME=web-7f65cc6544-9j58r;K8S_POD_NAMESPACE=default", "c1", "web-7f65cc6544@default"},
		{"IgnoreUnknown=1;K8S_POD_NAMESPACE=prod;K8S_POD_NAME=db-0", "c1", "db-0@prod"},
		{"K8S_POD_NAME=api.v2;K8S_POD_NAMESPACE=default", "c1", "api_v2@default"},
		{"", "0123abcdef", "_ctr@0123abcdef"},
		{"IgnoreUnknown=1", "ctr-1", "_ctr@ctr-1"},
	} {
		got, _, err := identify(&skel.CmdArgs{ContainerID: c.container, Args: c.args})
		if err != nil || got != c.want {
			t.Errorf("identify(%q, %q) = %q, %v; want %q", c.args, c.container, got, err, c.want)
		}
	}
}

// hostileArgs are CNI_ARGS that must never reach a path; each is CNI
// error 4 naming what is wrong.
var hostileArgs = []struct{ name, args, msg string }{
	{"dot-dot path", "K8S_POD_NAME=../../etc;K8S_POD_NAMESPACE=default", `pod name "../../etc"`},
	{"slash", "K8S_POD_NAME=a/b;K8S_POD_NAMESPACE=default", `pod name "a/b"`},
	{"upper case and underscore", "K8S_POD_NAME=Web_1;K8S_POD_NAMESPACE=default", `pod name "Web_1"`},
	{"leading dot", "K8S_POD_NAME=.hidden;K8S_POD_NAMESPACE=default", `pod name ".hidden"`},
	{"300 characters", "K8S_POD_NAME=" + strings.Repeat("a", 300) + ";K8S_POD_NAMESPACE=default", "1 to 253 characters"},
	{"NUL", "K8S_POD_NAME=x\x00;K8S_POD_NAMESPACE=default", `pod name "x\x00"`},
	{"namespace path", "K8S_POD_NAME=web;K8S_POD_NAMESPACE=../kube-system", `pod namespace "../kube-system"`},
	{"name without namespace", "K8S_POD_NAME=web", "pod namespace"},
	{"namespace without name", "K8S_POD_NAMESPACE=default", "pod name"},
	{"malformed pair", "K8S_POD_NAME", "not KEY=VALUE"},
}

func TestIdentifyRejects(t *testing.T) {
	for _, c := range hostileArgs {
		t.Run(c.name, func(t *testing.T) {
			_, _, err := identify(&skel.CmdArgs{ContainerID: "c1", Args: c.args})
			assertCNIError(t, err, types.ErrInvalidEnvironmentVariables, c.msg)
		})
	}
	// Without Kubernetes arguments the container ID names the identifier;
	// one that cannot be a path element is refused too.
	for _, id := range []string{"", "../x", "a/b", strings.Repeat("c", 254)} {
		_, _, err := identify(&skel.CmdArgs{ContainerID: id})
		assertCNIError(t, err, types.ErrInvalidEnvironmentVariables, "container id")
	}
}

// TestCommandsRejectBadInputEarly runs the handlers on input they must
// refuse before they touch the kernel or the pin root (which is a path that
// does not exist: anything created there would fail the test's cleanup
// check).
func TestCommandsRejectBadInputEarly(t *testing.T) {
	pinRoot := t.TempDir() + "/pins"
	stdin := withPrev(`"pinRoot": "`+pinRoot+`"`, `"policyDir": "`+t.TempDir()+`"`)
	cmds := map[string]func(*skel.CmdArgs) error{"ADD": cmdAdd, "CHECK": cmdCheck}
	for name, cmd := range cmds {
		for _, c := range hostileArgs {
			err := cmd(&skel.CmdArgs{ContainerID: "c1", Netns: "/var/run/netns/x", IfName: "eth0", Args: c.args, StdinData: stdin})
			var e *types.Error
			if !errors.As(err, &e) || e.Code != types.ErrInvalidEnvironmentVariables || !strings.Contains(e.Msg, c.msg) {
				t.Errorf("%s with %s: got %v, want code 4 containing %q", name, c.name, err, c.msg)
			}
		}
	}
	// ADD needs the pod's namespace.
	err := cmdAdd(&skel.CmdArgs{ContainerID: "c1", IfName: "eth0", Args: "K8S_POD_NAME=web;K8S_POD_NAMESPACE=default", StdinData: stdin})
	assertCNIError(t, err, types.ErrInvalidEnvironmentVariables, "CNI_NETNS")
	// Bad config comes before anything else, for every command.
	for name, cmd := range map[string]func(*skel.CmdArgs) error{"ADD": cmdAdd, "CHECK": cmdCheck, "DEL": cmdDel, "GC": cmdGC, "STATUS": cmdStatus} {
		err := cmd(&skel.CmdArgs{ContainerID: "c1", Netns: "/x", IfName: "eth0", StdinData: conf(`"pinRoot": "`+pinRoot+`"`, `"colour": "blue"`)})
		var e *types.Error
		if !errors.As(err, &e) || e.Code != types.ErrInvalidNetworkConfig || !strings.Contains(e.Msg, "colour") {
			t.Errorf("%s with an unknown key: got %v, want code 7 naming the key", name, err)
		}
	}
	if _, err := os.Lstat(pinRoot); err == nil {
		t.Errorf("rejected input created the pin root %s", pinRoot)
	}
}
