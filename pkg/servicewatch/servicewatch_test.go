package servicewatch

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

func service(t *testing.T, doc string) *unstructured.Unstructured {
	t.Helper()
	u := &unstructured.Unstructured{}
	if err := json.Unmarshal([]byte(doc), &u.Object); err != nil {
		t.Fatal(err)
	}
	return u
}

func TestFrontends(t *testing.T) {
	node := []netip.Addr{netip.MustParseAddr("192.168.50.2"), netip.MustParseAddr("fd00::2")}
	for _, c := range []struct {
		name, doc string
		want      string
	}{
		{"ClusterIP, both families, TCP by default and UDP",
			`{"spec":{"type":"ClusterIP","clusterIP":"10.96.0.10","clusterIPs":["10.96.0.10","fd00:96::a"],
			  "ports":[{"port":53,"protocol":"UDP"},{"port":53,"protocol":"TCP"},{"port":9153}]}}`,
			"[10.96.0.10:53/6 10.96.0.10:53/17 10.96.0.10:9153/6 [fd00:96::a]:53/6 [fd00:96::a]:53/17 [fd00:96::a]:9153/6]"},
		{"clusterIP alone (clusterIPs unset)",
			`{"spec":{"clusterIP":"10.96.0.11","ports":[{"port":80}]}}`, "[10.96.0.11:80/6]"},
		{"NodePort on every node address",
			`{"spec":{"type":"NodePort","clusterIPs":["10.96.0.12"],"ports":[{"port":80,"nodePort":30080}]}}`,
			"[10.96.0.12:80/6 192.168.50.2:30080/6 [fd00::2]:30080/6]"},
		{"external and load-balancer IPs; a Proxy ipMode is the load balancer's",
			`{"spec":{"type":"LoadBalancer","clusterIPs":["10.96.0.13"],"externalIPs":["203.0.113.7"],"ports":[{"port":443,"nodePort":31443}]},
			  "status":{"loadBalancer":{"ingress":[{"ip":"198.51.100.1"},{"ip":"198.51.100.2","ipMode":"Proxy"},{"hostname":"lb.example"}]}}}`,
			"[10.96.0.13:443/6 192.168.50.2:31443/6 198.51.100.1:443/6 203.0.113.7:443/6 [fd00::2]:31443/6]"},
		{"headless", `{"spec":{"clusterIP":"None","clusterIPs":["None"],"ports":[{"port":80}]}}`, "[]"},
		{"ExternalName", `{"spec":{"type":"ExternalName","externalName":"example.com","ports":[{"port":80}]}}`, "[]"},
		{"SCTP is left to the veth", `{"spec":{"clusterIPs":["10.96.0.14"],"ports":[{"port":9,"protocol":"SCTP"},{"port":10}]}}`,
			"[10.96.0.14:10/6]"},
		{"garbage ports and addresses are skipped",
			`{"spec":{"clusterIPs":["10.96.0.15","not-an-ip"],"ports":[{"port":0},{"port":70000},{"port":"80"},{"port":8080.5},{"port":81}]}}`,
			"[10.96.0.15:81/6]"},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := fmt.Sprint(Frontends(service(t, c.doc), node)); got != c.want {
				t.Errorf("Frontends = %s\nwant        %s", got, c.want)
			}
		})
	}
}
