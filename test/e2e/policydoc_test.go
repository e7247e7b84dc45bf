package e2e

import (
	"fmt"
	"strings"
)

// endpointDoc is a PolicyEndpoint document as the tests write them: it
// selects pods of namespace default by name and isolates the directions in
// isolate ("Ingress", "Egress"); a direction isolated without rules denies
// everything.
type endpointDoc struct {
	name            string
	pods            []string
	isolate         []string
	ingress, egress []docRule
	// hostIP, when set, makes the document what the API holds: the pods'
	// node and addresses, and the NetworkPolicy it came from, which the
	// CRD requires and the plugin ignores.
	hostIP string
}

// docRule is one rule: a CIDR, its excepts, and its ports (none: all).
type docRule struct {
	cidr   string
	except []string
	ports  []docPort
}

type docPort struct {
	proto     string
	port, end uint16 // end 0: the single port
}

func tcpRule(cidr string, ports ...uint16) docRule { return protoRule(cidr, "TCP", ports...) }

func protoRule(cidr, proto string, ports ...uint16) docRule {
	r := docRule{cidr: cidr}
	for _, p := range ports {
		r.ports = append(r.ports, docPort{proto: proto, port: p})
	}
	return r
}

func (d endpointDoc) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "apiVersion: networking.k8s.aws/v1alpha1\nkind: PolicyEndpoint\n")
	fmt.Fprintf(&b, "metadata: {name: %s, namespace: default}\nspec:\n", d.name)
	if d.hostIP != "" {
		fmt.Fprintf(&b, "  policyRef: {name: %s, namespace: default}\n", d.name)
	}
	fmt.Fprintf(&b, "  podIsolation: [%s]\n  podSelectorEndpoints:\n", strings.Join(d.isolate, ", "))
	for i, p := range d.pods {
		if d.hostIP != "" {
			fmt.Fprintf(&b, "  - {name: %s, namespace: default, hostIP: %s, podIP: 10.88.%d.%d}\n", p, d.hostIP, i/250, i%250+1)
			continue
		}
		fmt.Fprintf(&b, "  - {name: %s, namespace: default}\n", p)
	}
	for _, dir := range []struct {
		key   string
		rules []docRule
	}{{"ingress", d.ingress}, {"egress", d.egress}} {
		if len(dir.rules) == 0 {
			continue
		}
		fmt.Fprintf(&b, "  %s:\n", dir.key)
		for _, r := range dir.rules {
			fmt.Fprintf(&b, "  - cidr: %s\n", r.cidr)
			if len(r.except) > 0 {
				fmt.Fprintf(&b, "    except: [%s]\n", strings.Join(r.except, ", "))
			}
			if len(r.ports) > 0 {
				b.WriteString("    ports:\n")
			}
			for _, p := range r.ports {
				fmt.Fprintf(&b, "    - {protocol: %s, port: %d", p.proto, p.port)
				if p.end != 0 {
					fmt.Fprintf(&b, ", endPort: %d", p.end)
				}
				b.WriteString("}\n")
			}
		}
	}
	return b.String()
}

// allowFrom isolates the ingress of the named pods and allows TCP to port
// from the given clients.
func allowFrom(selected []string, port uint16, clients ...*pod) string {
	d := endpointDoc{name: "allow", pods: selected, isolate: []string{"Ingress"}}
	for _, cl := range clients {
		d.ingress = append(d.ingress, tcpRule(cl.ip.String()+"/32", port))
	}
	return d.String()
}

// selectPolicy selects the workloads of the named pods and isolates both
// directions, so that ADD writes real entries into the identifier's tries.
func selectPolicy(pods ...string) string {
	return endpointDoc{
		name: "select", pods: pods, isolate: []string{"Ingress", "Egress"},
		ingress: []docRule{
			tcpRule("10.77.0.0/16", 8080),
			{cidr: "fd77::/64", except: []string{"fd77::1/128"}, ports: []docPort{{proto: "UDP", port: 53, end: 60}}},
		},
		egress: []docRule{tcpRule("10.77.0.0/16", 8080)},
	}.String()
}

// egressOnly selects the bare pod name and isolates both directions with
// the given egress rules: nothing may come in but replies.
func egressOnly(name string, egress ...docRule) string {
	return endpointDoc{name: name, pods: []string{name}, isolate: []string{"Ingress", "Egress"}, egress: egress}.String()
}
