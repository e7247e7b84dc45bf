package conf

import (
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"

	"github.com/podfence/podfence/pkg/localhook"
)

const (
	sweeperManifest = "podfence-sweeper.yaml"

	bpffsPath   = "/sys/fs/bpf"
	pinRootFlag = "--pin-root=/sys/fs/bpf/podfence"
	metricsPort = 9465
)

// sweeperObjects is what podfence-sweeper.yaml is expected to hold.
type sweeperObjects struct {
	serviceAccount *corev1.ServiceAccount
	clusterRole    *rbacv1.ClusterRole
	binding        *rbacv1.ClusterRoleBinding
	daemonSet      *appsv1.DaemonSet
}

// splitDocuments splits a multi-document YAML file on "\n---" and drops
// documents that hold nothing but comments and blank lines.
func splitDocuments(data []byte) []string {
	var docs []string
	for doc := range strings.SplitSeq(string(data), "\n---") {
		if hasContent(doc) {
			docs = append(docs, doc)
		}
	}
	return docs
}

func hasContent(doc string) bool {
	for line := range strings.SplitSeq(doc, "\n") {
		line = strings.TrimSpace(line)
		if line != "" && !strings.HasPrefix(line, "#") {
			return true
		}
	}
	return false
}

// decodeDocument strictly decodes one YAML document into the k8s.io/api type
// named by its kind. Unknown kinds, unexpected apiVersions, unknown fields
// and duplicate keys are errors.
func decodeDocument(doc string) (any, error) {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
		return nil, fmt.Errorf("reading apiVersion/kind: %w", err)
	}

	var obj any
	var wantAPIVersion string
	switch tm.Kind {
	case "ServiceAccount":
		obj, wantAPIVersion = &corev1.ServiceAccount{}, "v1"
	case "DaemonSet":
		obj, wantAPIVersion = &appsv1.DaemonSet{}, "apps/v1"
	case "ClusterRole":
		obj, wantAPIVersion = &rbacv1.ClusterRole{}, "rbac.authorization.k8s.io/v1"
	case "ClusterRoleBinding":
		obj, wantAPIVersion = &rbacv1.ClusterRoleBinding{}, "rbac.authorization.k8s.io/v1"
	default:
		return nil, fmt.Errorf("unknown kind %q (apiVersion %q)", tm.Kind, tm.APIVersion)
	}
	if tm.APIVersion != wantAPIVersion {
		return nil, fmt.Errorf("%s has apiVersion %q, want %q", tm.Kind, tm.APIVersion, wantAPIVersion)
	}

	if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
		return nil, fmt.Errorf("%s: %w", tm.Kind, err)
	}
	if err := checkKeyCase(doc, obj); err != nil {
		return nil, fmt.Errorf("%s: %w", tm.Kind, err)
	}
	return obj, nil
}

// checkKeyCase closes a gap in UnmarshalStrict: encoding/json matches object
// keys to struct fields case-insensitively, so "hostnetwork: true" decodes
// as HostNetwork=true even in strict mode, while the API server matches
// keys case-sensitively and would drop or reject it. The decoded object is
// re-encoded and every key of the document must come back spelled the same.
// A key that comes back only under a different case is an error; a key that
// does not come back at all carried a zero value dropped by omitempty.
func checkKeyCase(doc string, decoded any) error {
	var original any
	if err := yaml.Unmarshal([]byte(doc), &original); err != nil {
		return err
	}
	encoded, err := json.Marshal(decoded)
	if err != nil {
		return err
	}
	var roundTrip any
	if err := json.Unmarshal(encoded, &roundTrip); err != nil {
		return err
	}
	return compareKeyCase("", original, roundTrip)
}

func compareKeyCase(path string, original, roundTrip any) error {
	switch o := original.(type) {
	case map[string]any:
		r, _ := roundTrip.(map[string]any)
		for _, key := range slices.Sorted(maps.Keys(o)) {
			if rv, ok := r[key]; ok {
				if err := compareKeyCase(path+"."+key, o[key], rv); err != nil {
					return err
				}
				continue
			}
			for rk := range r {
				if strings.EqualFold(rk, key) {
					return fmt.Errorf("key %s.%s is spelled %q in the API", path, key, rk)
				}
			}
		}
	case []any:
		r, _ := roundTrip.([]any)
		for i := range min(len(o), len(r)) {
			if err := compareKeyCase(path+"["+strconv.Itoa(i)+"]", o[i], r[i]); err != nil {
				return err
			}
		}
	}
	return nil
}

// loadSweeperManifest decodes every document of podfence-sweeper.yaml and
// fails the test unless it finds exactly one of each kind it expects.
func loadSweeperManifest(t *testing.T) sweeperObjects {
	t.Helper()
	data, err := os.ReadFile(sweeperManifest)
	if err != nil {
		t.Fatal(err)
	}

	var objs sweeperObjects
	for i, doc := range splitDocuments(data) {
		obj, err := decodeDocument(doc)
		if err != nil {
			t.Fatalf("%s document %d: %v", sweeperManifest, i, err)
		}
		switch obj := obj.(type) {
		case *corev1.ServiceAccount:
			setOnce(t, &objs.serviceAccount, obj)
		case *rbacv1.ClusterRole:
			setOnce(t, &objs.clusterRole, obj)
		case *rbacv1.ClusterRoleBinding:
			setOnce(t, &objs.binding, obj)
		case *appsv1.DaemonSet:
			setOnce(t, &objs.daemonSet, obj)
		}
	}
	if objs.serviceAccount == nil || objs.clusterRole == nil || objs.binding == nil || objs.daemonSet == nil {
		t.Fatalf("%s: want a ServiceAccount, a ClusterRole, a ClusterRoleBinding and a DaemonSet, got %+v", sweeperManifest, objs)
	}
	return objs
}

func setOnce[T any](t *testing.T, dst **T, obj *T) {
	t.Helper()
	if *dst != nil {
		t.Fatalf("%s: more than one %T", sweeperManifest, obj)
	}
	*dst = obj
}

// sweeperContainer returns the DaemonSet's only container.
func sweeperContainer(t *testing.T, ds *appsv1.DaemonSet) *corev1.Container {
	t.Helper()
	containers := ds.Spec.Template.Spec.Containers
	if len(containers) != 1 {
		t.Fatalf("DaemonSet has %d containers, want 1", len(containers))
	}
	return &containers[0]
}

// installContainer returns the DaemonSet's only init container.
func installContainer(t *testing.T, ds *appsv1.DaemonSet) *corev1.Container {
	t.Helper()
	inits := ds.Spec.Template.Spec.InitContainers
	if len(inits) != 1 || inits[0].Name != "install-cni" {
		t.Fatalf("DaemonSet init containers %+v, want exactly install-cni", inits)
	}
	return &inits[0]
}

// TestSweeperRBAC: the ServiceAccount may read PolicyEndpoints,
// ClusterPolicyEndpoints and Services and nothing else; test/e2e runs the sweeper with a token of that account.
func TestSweeperRBAC(t *testing.T) {
	objs := loadSweeperManifest(t)
	role, binding := objs.clusterRole, objs.binding
	want := []rbacv1.PolicyRule{{
		APIGroups: []string{"networking.k8s.aws"},
		Resources: []string{"policyendpoints", "clusterpolicyendpoints"},
		Verbs:     []string{"get", "list", "watch"},
	}, {
		APIGroups: []string{""},
		Resources: []string{"services"},
		Verbs:     []string{"get", "list", "watch"},
	}}
	if fmt.Sprint(role.Rules) != fmt.Sprint(want) {
		t.Errorf("ClusterRole rules = %+v, want exactly %+v", role.Rules, want)
	}
	if binding.RoleRef != (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role.Name}) {
		t.Errorf("binding roleRef = %+v, want the ClusterRole %q", binding.RoleRef, role.Name)
	}
	wantSubject := rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Name: objs.serviceAccount.Name, Namespace: "kube-system"}
	if !slices.Equal(binding.Subjects, []rbacv1.Subject{wantSubject}) {
		t.Errorf("binding subjects = %+v, want exactly %+v", binding.Subjects, wantSubject)
	}
}

// TestInstallCNIContainer: the init container chains podfence into the
// host's CNI directories with the same pin root and policy directory the
// sweeper uses, and with no capabilities.
func TestInstallCNIContainer(t *testing.T) {
	ds := loadSweeperManifest(t).daemonSet
	c := installContainer(t, ds)
	sweeper := sweeperContainer(t, ds)
	if c.Image != sweeper.Image || !slices.Equal(c.Command, sweeper.Command) {
		t.Errorf("install-cni runs %s %q, want the sweeper's image and binary", c.Image, c.Command)
	}
	if len(c.Args) == 0 || c.Args[0] != "install-cni" {
		t.Fatalf("args = %q, want the install-cni subcommand first", c.Args)
	}
	checkCNIDirs(t, ds, c)
	for _, f := range []string{pinRootFlag, "--policy-dir=/etc/podfence/policies"} {
		if !slices.Contains(c.Args, f) {
			t.Errorf("args = %q, missing %s (the conflist entry must match the sweeper)", c.Args, f)
		}
	}
	sc := c.SecurityContext
	if sc == nil || sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) ||
		len(sc.Capabilities.Add) != 0 || sc.Privileged == nil || *sc.Privileged {
		t.Errorf("install-cni securityContext = %+v, want unprivileged with every capability dropped", sc)
	}
}

// checkCNIDirs: c's --cni-conf-dir and --cni-bin-dir are the node's CNI
// directories, mounted writable.
func checkCNIDirs(t *testing.T, ds *appsv1.DaemonSet, c *corev1.Container) {
	t.Helper()
	for _, dir := range []struct{ flag, host string }{
		{"--cni-conf-dir", "/etc/cni/net.d"},
		{"--cni-bin-dir", "/opt/cni/bin"},
	} {
		i := slices.IndexFunc(c.Args, func(a string) bool { return strings.HasPrefix(a, dir.flag+"=") })
		if i < 0 {
			t.Errorf("args = %q, missing %s", c.Args, dir.flag)
			continue
		}
		mountPath := strings.TrimPrefix(c.Args[i], dir.flag+"=")
		mount, hp := hostPathMount(t, ds, c, mountPath)
		if hp.Path != dir.host || mount.ReadOnly {
			t.Errorf("%s=%s is host %s (readOnly %v), want writable %s", dir.flag, mountPath, hp.Path, mount.ReadOnly, dir.host)
		}
		if hp.Type == nil || *hp.Type != corev1.HostPathDirectory {
			t.Errorf("%s hostPath type = %v, want Directory (the primary CNI creates it)", dir.host, hp.Type)
		}
	}
}

// TestSweeperKeepsChain: the running sweeper keeps podfence in the chain,
// so it has the CNI directories too, and describes the same entry as the
// init container.
func TestSweeperKeepsChain(t *testing.T) {
	ds := loadSweeperManifest(t).daemonSet
	c := sweeperContainer(t, ds)
	for _, f := range []string{"--keep-chained", "--adopt"} {
		if !slices.Contains(c.Args, f) {
			t.Errorf("args = %q, missing %s", c.Args, f)
		}
	}
	checkCNIDirs(t, ds, c)
	install := installContainer(t, ds)
	for _, a := range install.Args[1:] {
		if !strings.HasPrefix(a, "--plugin=") && !slices.Contains(c.Args, a) {
			t.Errorf("install-cni has %s, the sweeper does not: a repaired chain would differ from the installed one", a)
		}
	}
}

func TestSweeperManifestObjects(t *testing.T) {
	objs := loadSweeperManifest(t)
	sa, ds := objs.serviceAccount, objs.daemonSet

	if sa.Name != "podfence-sweeper" {
		t.Errorf("ServiceAccount name = %q, want podfence-sweeper", sa.Name)
	}
	if ds.Name != "podfence-sweeper" {
		t.Errorf("DaemonSet name = %q, want podfence-sweeper", ds.Name)
	}
	// The file is applied with -n kube-system; a namespace baked into a
	// document would silently override that.
	if sa.Namespace != "" || ds.Namespace != "" {
		t.Errorf("documents set namespaces (%q, %q); the manifest must be namespace-less",
			sa.Namespace, ds.Namespace)
	}

	pod := ds.Spec.Template.Spec
	if pod.ServiceAccountName != sa.Name {
		t.Errorf("serviceAccountName = %q, want the manifest's ServiceAccount %q",
			pod.ServiceAccountName, sa.Name)
	}
	if pod.DeprecatedServiceAccount != "" && pod.DeprecatedServiceAccount != sa.Name {
		t.Errorf("deprecated serviceAccount = %q disagrees with %q", pod.DeprecatedServiceAccount, sa.Name)
	}
}

func TestSweeperSelectorMatchesTemplate(t *testing.T) {
	ds := loadSweeperManifest(t).daemonSet

	if ds.Spec.Selector == nil ||
		(len(ds.Spec.Selector.MatchLabels) == 0 && len(ds.Spec.Selector.MatchExpressions) == 0) {
		t.Fatal("DaemonSet selector is empty")
	}
	selector, err := metav1.LabelSelectorAsSelector(ds.Spec.Selector)
	if err != nil {
		t.Fatalf("invalid selector: %v", err)
	}
	templateLabels := labels.Set(ds.Spec.Template.Labels)
	if !selector.Matches(templateLabels) {
		t.Errorf("selector %q does not match template labels %v", selector, templateLabels)
	}
	if got := ds.Spec.Template.Labels["app.kubernetes.io/name"]; got != "podfence-sweeper" {
		t.Errorf("template label app.kubernetes.io/name = %q, want podfence-sweeper", got)
	}
}

func TestSweeperPodPlacement(t *testing.T) {
	ds := loadSweeperManifest(t).daemonSet
	pod := ds.Spec.Template.Spec

	if !pod.HostNetwork {
		t.Error("hostNetwork is not set: ctnetlink, TC hooks and address events live in the host netns")
	}
	if pod.DNSPolicy != corev1.DNSClusterFirstWithHostNet {
		t.Errorf("dnsPolicy = %q, want %q", pod.DNSPolicy, corev1.DNSClusterFirstWithHostNet)
	}
	if pod.HostPID || pod.HostIPC {
		t.Errorf("hostPID=%v hostIPC=%v; the sweeper needs neither", pod.HostPID, pod.HostIPC)
	}
	if pod.PriorityClassName != "system-node-critical" {
		t.Errorf("priorityClassName = %q, want system-node-critical", pod.PriorityClassName)
	}

	tolerateAll := false
	for _, tol := range pod.Tolerations {
		if tol.Operator == corev1.TolerationOpExists && tol.Key == "" && tol.Effect == "" {
			tolerateAll = true
		}
	}
	if !tolerateAll {
		t.Errorf("tolerations %+v do not include a bare operator: Exists; the sweeper must run on tainted nodes", pod.Tolerations)
	}

	if g := pod.TerminationGracePeriodSeconds; g == nil || *g != 30 {
		t.Errorf("terminationGracePeriodSeconds = %v, want 30", g)
	}

	us := ds.Spec.UpdateStrategy
	if us.Type != appsv1.RollingUpdateDaemonSetStrategyType || us.RollingUpdate == nil ||
		us.RollingUpdate.MaxUnavailable == nil || us.RollingUpdate.MaxUnavailable.String() != "10%" {
		t.Errorf("updateStrategy = %+v, want RollingUpdate with maxUnavailable 10%%", us)
	}
}

func TestSweeperCommandLine(t *testing.T) {
	c := sweeperContainer(t, loadSweeperManifest(t).daemonSet)

	if !slices.Equal(c.Command, []string{"/usr/local/bin/podfence-sweeper"}) {
		t.Errorf("command = %q, want [/usr/local/bin/podfence-sweeper]", c.Command)
	}
	if len(c.Args) == 0 || c.Args[0] != "run" {
		t.Errorf("args = %q, want the run subcommand first", c.Args)
	}
	if !slices.Contains(c.Args, pinRootFlag) {
		t.Errorf("args = %q, missing %s", c.Args, pinRootFlag)
	}
	if c.Image != "ghcr.io/podfence/podfence:latest" {
		t.Errorf("image = %q", c.Image)
	}
	if c.ImagePullPolicy != corev1.PullIfNotPresent {
		t.Errorf("imagePullPolicy = %q, want IfNotPresent", c.ImagePullPolicy)
	}

	var nodeName *corev1.EnvVar
	for i := range c.Env {
		if c.Env[i].Name == "NODE_NAME" {
			nodeName = &c.Env[i]
		}
	}
	if nodeName == nil || nodeName.ValueFrom == nil || nodeName.ValueFrom.FieldRef == nil ||
		nodeName.ValueFrom.FieldRef.FieldPath != "spec.nodeName" {
		t.Errorf("env NODE_NAME = %+v, want valueFrom.fieldRef.fieldPath spec.nodeName", nodeName)
	}
}

func TestSweeperSecurityContext(t *testing.T) {
	ds := loadSweeperManifest(t).daemonSet
	c := sweeperContainer(t, ds)
	sc := c.SecurityContext
	if sc == nil {
		t.Fatal("container has no securityContext")
	}

	if sc.Privileged == nil || *sc.Privileged {
		t.Error("privileged must be explicitly false")
	}
	if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		t.Error("allowPrivilegeEscalation must be explicitly false")
	}
	if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		t.Error("readOnlyRootFilesystem must be true")
	}
	if sc.RunAsUser == nil || *sc.RunAsUser != 0 {
		t.Errorf("runAsUser = %v, want 0", sc.RunAsUser)
	}

	seccomp := sc.SeccompProfile
	if seccomp == nil && ds.Spec.Template.Spec.SecurityContext != nil {
		seccomp = ds.Spec.Template.Spec.SecurityContext.SeccompProfile
	}
	if seccomp == nil || seccomp.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("seccompProfile = %+v, want RuntimeDefault", seccomp)
	}

	if sc.Capabilities == nil {
		t.Fatal("no capabilities section: the runtime's default set would apply")
	}
	if !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("capabilities.drop = %q, want exactly [ALL]", sc.Capabilities.Drop)
	}
	added := slices.Sorted(slices.Values(sc.Capabilities.Add))
	want := []corev1.Capability{"BPF", "NET_ADMIN", "PERFMON", "SYS_ADMIN", "SYS_RESOURCE"}
	if !slices.Equal(added, want) {
		t.Errorf("capabilities.add = %q, want exactly %q (any order)", sc.Capabilities.Add, want)
	}
}

// hostPathMount finds the container mount at mountPath and the hostPath
// volume behind it.
func hostPathMount(t *testing.T, ds *appsv1.DaemonSet, c *corev1.Container, mountPath string) (corev1.VolumeMount, *corev1.HostPathVolumeSource) {
	t.Helper()
	i := slices.IndexFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return m.MountPath == mountPath })
	if i < 0 {
		t.Fatalf("nothing is mounted at %s", mountPath)
	}
	mount := c.VolumeMounts[i]
	volumes := ds.Spec.Template.Spec.Volumes
	j := slices.IndexFunc(volumes, func(v corev1.Volume) bool { return v.Name == mount.Name })
	if j < 0 {
		t.Fatalf("mount %s refers to undeclared volume %q", mountPath, mount.Name)
	}
	if volumes[j].HostPath == nil {
		t.Fatalf("volume %q mounted at %s is not a hostPath", mount.Name, mountPath)
	}
	return mount, volumes[j].HostPath
}

func TestSweeperVolumes(t *testing.T) {
	ds := loadSweeperManifest(t).daemonSet
	c := sweeperContainer(t, ds)

	bpfMount, bpffs := hostPathMount(t, ds, c, bpffsPath)
	if bpffs.Path != bpffsPath {
		t.Errorf("volume mounted at %s comes from host %s, want %s", bpffsPath, bpffs.Path, bpffsPath)
	}
	if bpffs.Type == nil || *bpffs.Type != corev1.HostPathDirectory {
		t.Errorf("bpffs hostPath type = %v, want Directory (the node mounts bpffs, nobody creates it)", bpffs.Type)
	}
	if bpfMount.ReadOnly {
		t.Error("bpffs is mounted read-only, but the sweeper removes orphaned pins")
	}
	pinRoot := strings.TrimPrefix(pinRootFlag, "--pin-root=")
	if !strings.HasPrefix(pinRoot, bpfMount.MountPath+"/") {
		t.Errorf("pin root %s is not under the bpffs mount %s", pinRoot, bpfMount.MountPath)
	}

	runMount, run := hostPathMount(t, ds, c, "/run")
	if run.Path != "/run" {
		t.Errorf("volume mounted at /run comes from host %s, want /run", run.Path)
	}
	if runMount.ReadOnly {
		t.Error("/run is mounted read-only, but the xtables lock lives there")
	}

	policyMount, policies := hostPathMount(t, ds, c, "/etc/podfence/policies")
	if policies.Path != "/etc/podfence/policies" {
		t.Errorf("policies come from host %s, want /etc/podfence/policies", policies.Path)
	}
	if policyMount.ReadOnly {
		t.Error("policies are mounted read-only, but --policy-source=kubernetes mirrors into them")
	}
	if !slices.Contains(c.Args, "--policy-source=kubernetes") {
		t.Errorf("args = %q, missing --policy-source=kubernetes", c.Args)
	}

	// The local judge's default (--judge-local-cgroup=auto) looks for the
	// host's cgroup hierarchy where this mounts it first.
	cgMount, cg := hostPathMount(t, ds, c, localhook.Candidates[0])
	if cg.Path != "/sys/fs/cgroup" || !cgMount.ReadOnly {
		t.Errorf("%s is host %s (readOnly %v), want /sys/fs/cgroup read-only", localhook.Candidates[0], cg.Path, cgMount.ReadOnly)
	}
	if slices.ContainsFunc(c.Args, func(a string) bool { return strings.HasPrefix(a, "--judge-local-cgroup") }) {
		t.Errorf("args = %q: --judge-local-cgroup should keep its default, auto", c.Args)
	}

	// Bidirectional propagation is only allowed for privileged containers.
	for _, m := range c.VolumeMounts {
		if m.MountPropagation != nil && *m.MountPropagation == corev1.MountPropagationBidirectional {
			t.Errorf("mount %s uses Bidirectional propagation, which needs privileged", m.MountPath)
		}
	}
}

// metricsContainerPort returns the container port named "metrics".
func metricsContainerPort(t *testing.T, c *corev1.Container) corev1.ContainerPort {
	t.Helper()
	i := slices.IndexFunc(c.Ports, func(p corev1.ContainerPort) bool { return p.Name == "metrics" })
	if i < 0 {
		t.Fatalf("no container port named metrics in %+v", c.Ports)
	}
	return c.Ports[i]
}

// resolvePort turns a probe's port (a number or a port name) into a number.
func resolvePort(c *corev1.Container, port intstr.IntOrString) (int32, bool) {
	if port.Type == intstr.Int {
		return port.IntVal, true
	}
	for _, p := range c.Ports {
		if p.Name == port.StrVal {
			return p.ContainerPort, true
		}
	}
	return 0, false
}

// checkHealthzProbe asserts that probe is an HTTP GET of /healthz on the
// named metrics port.
func checkHealthzProbe(t *testing.T, name string, probe *corev1.Probe, c *corev1.Container, metrics corev1.ContainerPort) {
	t.Helper()
	if probe == nil || probe.HTTPGet == nil {
		t.Errorf("%s is not an httpGet probe: %+v", name, probe)
		return
	}
	get := probe.HTTPGet
	if get.Path != "/healthz" {
		t.Errorf("%s path = %q, want /healthz", name, get.Path)
	}
	if get.Scheme != "" && get.Scheme != corev1.URISchemeHTTP {
		t.Errorf("%s scheme = %q, want HTTP", name, get.Scheme)
	}
	if get.Port.Type != intstr.String || get.Port.StrVal != metrics.Name {
		t.Errorf("%s port = %s, want the named port %s", name, get.Port.String(), metrics.Name)
	}
	if n, ok := resolvePort(c, get.Port); !ok || n != metrics.ContainerPort {
		t.Errorf("%s port %s resolves to %d (found=%v), want %d", name, get.Port.String(), n, ok, metrics.ContainerPort)
	}
}

func TestSweeperMetricsPortAndProbes(t *testing.T) {
	ds := loadSweeperManifest(t).daemonSet
	c := sweeperContainer(t, ds)

	port := metricsContainerPort(t, c)
	if port.ContainerPort != metricsPort {
		t.Errorf("metrics containerPort = %d, want %d", port.ContainerPort, metricsPort)
	}
	if port.Protocol != corev1.ProtocolTCP {
		t.Errorf("metrics protocol = %q, want TCP", port.Protocol)
	}
	// With hostNetwork the API server requires hostPort to be unset or
	// equal to containerPort.
	if port.HostPort != 0 && port.HostPort != port.ContainerPort {
		t.Errorf("hostPort %d differs from containerPort %d under hostNetwork", port.HostPort, port.ContainerPort)
	}

	var addrs []string
	for _, arg := range c.Args {
		if v, ok := strings.CutPrefix(arg, "--metrics-addr="); ok {
			addrs = append(addrs, v)
		}
	}
	if len(addrs) != 1 {
		t.Fatalf("args %q carry %d --metrics-addr flags, want 1", c.Args, len(addrs))
	}
	host, listenPort, err := net.SplitHostPort(addrs[0])
	if err != nil {
		t.Fatalf("--metrics-addr=%s: %v", addrs[0], err)
	}
	if listenPort != strconv.Itoa(int(port.ContainerPort)) {
		t.Errorf("--metrics-addr listens on port %s, but the metrics containerPort is %d", listenPort, port.ContainerPort)
	}
	// The kubelet probes the pod IP, which is the node IP here; a loopback
	// listener would fail every probe.
	if host != "" && host != "0.0.0.0" && host != "::" {
		t.Errorf("--metrics-addr binds %q; probes need all interfaces", host)
	}

	checkHealthzProbe(t, "livenessProbe", c.LivenessProbe, c, port)
	checkHealthzProbe(t, "readinessProbe", c.ReadinessProbe, c, port)

	if lp := c.LivenessProbe; lp != nil {
		if lp.InitialDelaySeconds != 10 || lp.PeriodSeconds != 10 || lp.FailureThreshold != 6 {
			t.Errorf("livenessProbe timing = delay %ds, period %ds, threshold %d; want 10, 10, 6",
				lp.InitialDelaySeconds, lp.PeriodSeconds, lp.FailureThreshold)
		}
	}
	if rp := c.ReadinessProbe; rp != nil && rp.PeriodSeconds != 5 {
		t.Errorf("readinessProbe periodSeconds = %d, want 5", rp.PeriodSeconds)
	}
}

func TestSweeperResources(t *testing.T) {
	c := sweeperContainer(t, loadSweeperManifest(t).daemonSet)
	req, lim := c.Resources.Requests, c.Resources.Limits

	wantQuantity := func(what string, list corev1.ResourceList, name corev1.ResourceName, want string) {
		t.Helper()
		got, ok := list[name]
		if !ok {
			t.Errorf("%s %s is not set", what, name)
			return
		}
		if got.Cmp(resource.MustParse(want)) != 0 {
			t.Errorf("%s %s = %s, want %s", what, name, got.String(), want)
		}
	}
	wantQuantity("request", req, corev1.ResourceCPU, "50m")
	wantQuantity("request", req, corev1.ResourceMemory, "64Mi")
	wantQuantity("limit", lim, corev1.ResourceMemory, "256Mi")

	if cpu, ok := lim[corev1.ResourceCPU]; ok {
		t.Errorf("CPU limit %s is set; throttling the sweeper only delays garbage collection", cpu.String())
	}
	if mreq, mlim := req[corev1.ResourceMemory], lim[corev1.ResourceMemory]; mreq.Cmp(mlim) > 0 {
		t.Errorf("memory request %s exceeds limit %s", mreq.String(), mlim.String())
	}
}

// daemonSetDocument returns the DaemonSet document of the manifest as text.
func daemonSetDocument(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile(sweeperManifest)
	if err != nil {
		t.Fatal(err)
	}
	for _, doc := range splitDocuments(data) {
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal([]byte(doc), &tm); err == nil && tm.Kind == "DaemonSet" {
			return doc
		}
	}
	t.Fatal("no DaemonSet document")
	return ""
}

var hostNetworkLine = regexp.MustCompile(`(?m)^(\s*)hostNetwork: true$`)

// replaceHostNetworkLine rewrites the single "hostNetwork: true" line of doc;
// the {indent} placeholder in repl is replaced by that line's indentation.
func replaceHostNetworkLine(t *testing.T, doc, repl string) string {
	t.Helper()
	m := hostNetworkLine.FindAllStringSubmatch(doc, -1)
	if len(m) != 1 {
		t.Fatalf("found %d hostNetwork: true lines in the DaemonSet, want 1", len(m))
	}
	indent := m[0][1]
	return hostNetworkLine.ReplaceAllLiteralString(doc, strings.ReplaceAll(repl, "{indent}", indent))
}

func TestStrictDecodingRejectsMisspelledField(t *testing.T) {
	doc := daemonSetDocument(t)
	var ds appsv1.DaemonSet
	if err := yaml.UnmarshalStrict([]byte(doc), &ds); err != nil {
		t.Fatalf("the unmodified DaemonSet must decode: %v", err)
	}

	broken := replaceHostNetworkLine(t, doc, "{indent}hostNetwrok: true")

	// The lenient decoder drops the unknown key without a word, leaving a
	// pod that is not on the host network.
	var lenient appsv1.DaemonSet
	if err := yaml.Unmarshal([]byte(broken), &lenient); err != nil {
		t.Fatalf("lenient decoding failed: %v", err)
	}
	if lenient.Spec.Template.Spec.HostNetwork {
		t.Fatal("misspelled key still set hostNetwork")
	}

	var strict appsv1.DaemonSet
	err := yaml.UnmarshalStrict([]byte(broken), &strict)
	if err == nil {
		t.Fatal("UnmarshalStrict accepted hostNetwrok")
	}
	if !strings.Contains(err.Error(), "hostNetwrok") {
		t.Errorf("error does not name the bad field: %v", err)
	}
	if _, err := decodeDocument(broken); err == nil {
		t.Error("decodeDocument accepted hostNetwrok")
	}
}

func TestStrictDecodingRejectsDuplicateKey(t *testing.T) {
	doc := replaceHostNetworkLine(t, daemonSetDocument(t),
		"{indent}hostNetwork: true\n{indent}hostNetwork: false")

	var ds appsv1.DaemonSet
	if err := yaml.UnmarshalStrict([]byte(doc), &ds); err == nil {
		t.Fatal("UnmarshalStrict accepted a duplicated hostNetwork key")
	}
}

func TestDecodingRejectsMiscasedKey(t *testing.T) {
	doc := replaceHostNetworkLine(t, daemonSetDocument(t), "{indent}hostnetwork: true")

	// encoding/json folds case, so strict decoding alone lets this through.
	var ds appsv1.DaemonSet
	if err := yaml.UnmarshalStrict([]byte(doc), &ds); err != nil {
		t.Logf("UnmarshalStrict now rejects miscased keys itself: %v", err)
	}
	if _, err := decodeDocument(doc); err == nil {
		t.Fatal("decodeDocument accepted hostnetwork (the API server would not)")
	} else if !strings.Contains(err.Error(), "hostnetwork") {
		t.Errorf("error does not name the bad key: %v", err)
	}
}

func TestDecodingRejectsUnknownKind(t *testing.T) {
	doc := "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n"
	if _, err := decodeDocument(doc); err == nil {
		t.Fatal("decodeDocument accepted a ConfigMap")
	}
	if _, err := decodeDocument("apiVersion: apps/v1beta2\nkind: DaemonSet\n"); err == nil {
		t.Fatal("decodeDocument accepted DaemonSet in apps/v1beta2")
	}
}
