package podid

import (
	"errors"
	"strings"
	"testing"
)

func TestFromPod(t *testing.T) {
	for _, c := range []struct {
		name, namespace string
		want            ID
	}{
		{"web-7f65cc6544-9j58r", "default", "web-7f65cc6544@default"},
		{"web-7f65cc6544-x2k4p", "default", "web-7f65cc6544@default"},
		{"db-0", "prod", "db-0@prod"},
		{"nginx", "default", "nginx@default"},
		{"my-hello", "default", "my-hello@default"},         // "hello" has vowels: not generated
		{"node-exporter-bcdfg", "mon", "node-exporter@mon"}, // DaemonSet suffix
		{"job-abcd", "default", "job-abcd@default"},         // four characters: not generated
		{"api.v2-7f65cc6544-9j58r", "default", "api_v2-7f65cc6544@default"},
		{"a", "b", "a@b"},
	} {
		got, err := FromPod(c.name, c.namespace)
		if err != nil || got != c.want {
			t.Errorf("FromPod(%q, %q) = %q, %v; want %q", c.name, c.namespace, got, err, c.want)
		}
		if err == nil && !Valid(string(got)) {
			t.Errorf("FromPod(%q, %q) = %q, which Valid refuses", c.name, c.namespace, got)
		}
	}
}

func TestFromPodRejects(t *testing.T) {
	for _, c := range []struct{ name, namespace, msg string }{
		{"", "default", "pod name"},
		{"web", "", "pod namespace"},
		{"../etc", "default", "pod name"},
		{"web/x", "default", "pod name"},
		{"web", "de/fault", "pod namespace"},
		{"Web", "default", "pod name"},
		{"web\x00", "default", "pod name"},
		{"-web", "default", "pod name"},
		{"web-", "default", "pod name"},
		{"web..x", "default", "pod name"},
		{"web", "a.b", "pod namespace"},
		{"web_1", "default", "pod name"},
		{"web@x", "default", "pod name"},
		{strings.Repeat("a", 254), "default", "pod name"},
		{"web", strings.Repeat("a", 64), "pod namespace"},
	} {
		_, err := FromPod(c.name, c.namespace)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("FromPod(%q, %q): got %v, want ErrInvalid naming the %s", c.name, c.namespace, err, c.msg)
		}
	}
}

func TestLongNamesStayDistinct(t *testing.T) {
	base := strings.Repeat("a", 240)
	a, err := FromPod(base+"-x", "default")
	if err != nil {
		t.Fatal(err)
	}
	b, err := FromPod(base+"-y", "default")
	if err != nil {
		t.Fatal(err)
	}
	if a == b || len(a) > maxLen || len(b) > maxLen || !Valid(string(a)) {
		t.Errorf("long names: %q and %q", a, b)
	}
}

func TestFromContainerID(t *testing.T) {
	id, err := FromContainerID("0123abcd")
	if err != nil || id != "_ctr@0123abcd" || !Valid(string(id)) {
		t.Errorf("got %q, %v", id, err)
	}
	a, errA := FromContainerID("ctr.1")
	b, errB := FromContainerID("ctr_1")
	if errA != nil || errB != nil || a == b || !Valid(string(a)) {
		t.Errorf("dotted container id: %q (%v) vs %q (%v)", a, errA, b, errB)
	}
	for _, bad := range []string{"", "../x", "a/b", "a%b", "a@b", strings.Repeat("a", 254)} {
		if _, err := FromContainerID(bad); !errors.Is(err, ErrInvalid) {
			t.Errorf("FromContainerID(%q): got %v, want ErrInvalid", bad, err)
		}
	}
}
