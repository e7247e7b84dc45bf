package node

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// pki is the node's credentials: a CA that signs the API server's serving
// certificate, the service-account signing key, and one bearer token per
// client. Every component is a cluster admin (system:masters): the node
// tests podfence, not Kubernetes' authorization.
type pki struct {
	dir        string
	caPEM      []byte
	serverCert string
	serverKey  string
	saKey      string
	tokens     string // the API server's --token-auth-file
	token      string // the admin token every client uses
}

// newPKI writes the credentials into dir. The serving certificate names
// every address a client uses: the node's, the kubernetes Service's, and
// the loopback the root namespace's forwarder connects from.
func newPKI(dir string) (*pki, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	p := &pki{dir: dir}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "podfence-node-ca"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(30 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, err
	}
	p.caPEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER})

	srvKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	srvTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "kube-apiserver"},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(30 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses:  []net.IP{NodeIP.AsSlice(), APIServiceIP.AsSlice(), net.IPv4(127, 0, 0, 1)},
		DNSNames: []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
			"kubernetes.default.svc.cluster.local", NodeName},
	}
	srvDER, err := x509.CreateCertificate(rand.Reader, srvTmpl, ca, &srvKey.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tok := make([]byte, 16)
	if _, err := rand.Read(tok); err != nil {
		return nil, err
	}
	p.token = fmt.Sprintf("%x", tok)
	for _, f := range []struct {
		name string
		data []byte
		out  *string
	}{
		{"ca.crt", p.caPEM, nil},
		{"apiserver.crt", pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srvDER}), &p.serverCert},
		{"apiserver.key", keyPEM(srvKey), &p.serverKey},
		{"sa.key", keyPEM(saKey), &p.saKey},
		{"tokens.csv", []byte(p.token + ",admin,admin,\"system:masters\"\n"), &p.tokens},
	} {
		path := filepath.Join(dir, f.name)
		if err := os.WriteFile(path, f.data, 0o600); err != nil {
			return nil, err
		}
		if f.out != nil {
			*f.out = path
		}
	}
	return p, nil
}

func keyPEM(k *ecdsa.PrivateKey) []byte {
	der, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		panic(err) // a P-256 key always marshals
	}
	return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})
}

// caFile is the CA certificate's path.
func (p *pki) caFile() string { return filepath.Join(p.dir, "ca.crt") }

// writeKubeconfig writes an admin kubeconfig for server to path.
func (p *pki) writeKubeconfig(path, server string) error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["podfence-node"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: p.caPEM}
	cfg.AuthInfos["admin"] = &clientcmdapi.AuthInfo{Token: p.token}
	cfg.Contexts["podfence-node"] = &clientcmdapi.Context{Cluster: "podfence-node", AuthInfo: "admin"}
	cfg.CurrentContext = "podfence-node"
	return clientcmd.WriteToFile(*cfg, path)
}
