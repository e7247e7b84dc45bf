package realnode

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/podfence/podfence/test/node"
)

// evidence records, while the suite runs, what decides its cases: every
// version of every PolicyEndpoint the controller writes, and every packet
// podfence denies (the sweeper's trace). A failed case is then explained
// by what the node held and dropped during it.
type evidence struct {
	cancel context.CancelFunc
	trace  *exec.Cmd
	wg     sync.WaitGroup

	mu     sync.Mutex
	pes    []seenPE
	denies []deny
	errs   []error
}

// seenPE is a PolicyEndpoint as the watch delivered it.
type seenPE struct {
	At      time.Time
	Deleted bool
	Object  policyEndpoint
}

// policyEndpoint holds the fields of the controller's PolicyEndpoint that
// decide traffic.
type policyEndpoint struct {
	Metadata struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	} `json:"metadata"`
	Spec struct {
		PolicyRef            struct{ Name string } `json:"policyRef"`
		PodIsolation         []string              `json:"podIsolation"`
		PodSelectorEndpoints []struct {
			PodIP string `json:"podIP"`
			Name  string `json:"name"`
		} `json:"podSelectorEndpoints"`
		Ingress []peerRule `json:"ingress"`
		Egress  []peerRule `json:"egress"`
	} `json:"spec"`
}

type peerRule struct {
	CIDR   string   `json:"cidr"`
	Except []string `json:"except"`
	Ports  []struct {
		Protocol string `json:"protocol"`
		Port     *int   `json:"port"`
		EndPort  *int   `json:"endPort"`
	} `json:"ports"`
}

// deny is one event of the sweeper's trace --json.
type deny struct {
	Time       time.Time `json:"time"`
	Identifier string    `json:"identifier"`
	Direction  string    `json:"direction"`
	Reason     string    `json:"reason"`
	Protocol   string    `json:"protocol"`
	Src        string    `json:"src"`
	Dst        string    `json:"dst"`
}

var policyEndpoints = schema.GroupVersionResource{Group: "networking.k8s.aws", Version: "v1alpha1", Resource: "policyendpoints"}

// recordEvidence starts the PolicyEndpoint watch and the trace.
func recordEvidence(n *node.Node) (*evidence, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", n.Kubeconfig)
	if err != nil {
		return nil, err
	}
	dc, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	w, err := dc.Resource(policyEndpoints).Namespace("").Watch(ctx, metav1.ListOptions{})
	if err != nil {
		cancel()
		return nil, err
	}
	e := &evidence{cancel: cancel}
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		defer w.Stop()
		for ev := range w.ResultChan() {
			b, err := json.Marshal(ev.Object)
			var pe policyEndpoint
			if err == nil {
				err = json.Unmarshal(b, &pe)
			}
			e.mu.Lock()
			if err != nil {
				e.errs = append(e.errs, fmt.Errorf("PolicyEndpoint watch: %w", err))
			} else {
				e.pes = append(e.pes, seenPE{At: time.Now(), Deleted: ev.Type == "DELETED", Object: pe})
			}
			e.mu.Unlock()
		}
	}()

	e.trace = n.Exec(filepath.Join(n.Tools, "kubectl"), "-n", "kube-system", "exec", "ds/podfence-sweeper", "-c", "sweeper", "--",
		"/usr/local/bin/podfence-sweeper", "trace", "--json")
	out, err := e.trace.StdoutPipe()
	if err != nil {
		e.stop()
		return nil, err
	}
	e.trace.Stderr = os.Stderr
	if err := e.trace.Start(); err != nil {
		e.stop()
		return nil, err
	}
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		s := bufio.NewScanner(out)
		for s.Scan() {
			var d deny
			err := json.Unmarshal(s.Bytes(), &d)
			e.mu.Lock()
			if err != nil {
				e.errs = append(e.errs, fmt.Errorf("trace: %q: %w", s.Text(), err))
			} else {
				e.denies = append(e.denies, d)
			}
			e.mu.Unlock()
		}
	}()
	return e, nil
}

// stop ends the watch and the trace.
func (e *evidence) stop() {
	e.cancel()
	if e.trace != nil && e.trace.Process != nil {
		e.trace.Process.Kill()
		e.trace.Wait()
	}
	e.wg.Wait()
}

// explain writes what decided a case that ran from start to end: the last
// version of each PolicyEndpoint written in that time, and the packets
// podfence denied meanwhile.
func (e *evidence) explain(w io.Writer, start, end time.Time) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, err := range e.errs {
		fmt.Fprintf(w, "  (evidence incomplete: %v)\n", err)
	}
	last := map[string]seenPE{}
	var names []string
	for _, p := range e.pes {
		if p.At.Before(start) || p.At.After(end) {
			continue
		}
		k := p.Object.Metadata.Namespace + "/" + p.Object.Metadata.Name
		if _, ok := last[k]; !ok {
			names = append(names, k)
		}
		if !p.Deleted { // a deletion keeps the version the case ran with
			last[k] = p
		}
	}
	slices.Sort(names)
	for _, k := range names {
		p, ok := last[k]
		if !ok {
			continue
		}
		s := p.Object.Spec
		var pods []string
		for _, ep := range s.PodSelectorEndpoints {
			pods = append(pods, ep.Name+"="+ep.PodIP)
		}
		fmt.Fprintf(w, "  PolicyEndpoint %s (policy %s, isolates %v, selects %s)\n", k, s.PolicyRef.Name, s.PodIsolation, strings.Join(pods, " "))
		for _, dir := range []struct {
			name  string
			rules []peerRule
		}{{"ingress", s.Ingress}, {"egress", s.Egress}} {
			for _, r := range dir.rules {
				fmt.Fprintf(w, "    %s %s%s%s\n", dir.name, r.CIDR, exceptText(r.Except), portsText(r))
			}
		}
	}
	n := 0
	for _, d := range e.denies {
		if d.Time.Before(start) || d.Time.After(end) {
			continue
		}
		if n++; n > 20 {
			continue
		}
		fmt.Fprintf(w, "  denied %s %s %s -> %s (%s, %s)\n", d.Time.Format("15:04:05.000"), d.Protocol, d.Src, d.Dst, d.Direction, d.Reason)
	}
	switch {
	case n == 0:
		fmt.Fprintf(w, "  podfence denied no packet during the case\n")
	case n > 20:
		fmt.Fprintf(w, "  ... %d denied packets in all\n", n)
	}
}

func exceptText(ex []string) string {
	if len(ex) == 0 {
		return ""
	}
	return " except " + strings.Join(ex, ",")
}

func portsText(r peerRule) string {
	if len(r.Ports) == 0 {
		return " all ports"
	}
	var ps []string
	for _, p := range r.Ports {
		s := p.Protocol
		if p.Port != nil {
			s += fmt.Sprintf("/%d", *p.Port)
		}
		if p.EndPort != nil {
			s += fmt.Sprintf("-%d", *p.EndPort)
		}
		ps = append(ps, s)
	}
	return " " + strings.Join(ps, ",")
}
