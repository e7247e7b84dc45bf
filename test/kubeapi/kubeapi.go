// Package kubeapi starts a real etcd and kube-apiserver for tests, the ones
// hack/k8s-tools.sh builds from their Go modules, inside a network namespace
// of the test's choosing (the node namespace, so that a sweeper started
// there reaches the API on 127.0.0.1 as a host-network pod would).
//
// Tests find the binaries through PODFENCE_K8S_TOOLS (make test sets it);
// without it they skip, unless PODFENCE_REQUIRE_K8S=1 makes that a failure.
// Everything a server writes lives in the test's temporary directory, and
// both processes are stopped when the test ends.
package kubeapi

import (
	"cmp"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// Env names the variables tests read.
const (
	ToolsEnv   = "PODFENCE_K8S_TOOLS"
	RequireEnv = "PODFENCE_REQUIRE_K8S"
)

// adminToken authenticates the tests' own client as a cluster admin
// (system:masters); what the sweeper gets is the test's choice.
const adminToken = "podfence-test-admin"

// Options configure Start.
type Options struct {
	// Netns is where etcd and the API server listen, on 127.0.0.1.
	Netns ns.NetNS
	// CompactEvery, if set, has the API server compact etcd's history
	// that often (default 5m), so that a watch resuming from an older
	// resourceVersion is answered 410 Gone.
	CompactEvery time.Duration
}

// Server is a running etcd and kube-apiserver.
type Server struct {
	tb      testing.TB
	netns   ns.NetNS
	tools   string
	dir     string
	url     string
	port    int
	caPEM   []byte
	etcd    *process
	api     *process
	apiArgs []string
	logs    *os.File
}

// Start starts etcd and the API server and waits until the server is ready.
func Start(tb testing.TB, opts Options) *Server {
	tb.Helper()
	tools := os.Getenv(ToolsEnv)
	if tools == "" {
		if os.Getenv(RequireEnv) == "1" {
			tb.Fatalf("%s is not set: run hack/k8s-tools.sh (make test does)", ToolsEnv)
		}
		tb.Skipf("%s is not set: no kube-apiserver to test against (make test builds one)", ToolsEnv)
	}
	if opts.Netns == nil {
		tb.Fatal("kubeapi: Options.Netns is required")
	}
	s := &Server{tb: tb, netns: opts.Netns, tools: tools, dir: tb.TempDir()}
	logs, err := os.Create(filepath.Join(s.dir, "server.log"))
	if err != nil {
		tb.Fatal(err)
	}
	s.logs = logs
	tb.Cleanup(s.stop)

	ports := s.freePorts(3)
	s.port = ports[2]
	s.url = "https://127.0.0.1:" + strconv.Itoa(s.port)
	certFile, keyFile, saKey := s.writeCredentials()

	etcdURL := "http://127.0.0.1:" + strconv.Itoa(ports[0])
	s.etcd = s.start(filepath.Join(tools, "etcd"),
		"--data-dir="+filepath.Join(s.dir, "etcd"),
		"--listen-client-urls="+etcdURL,
		"--advertise-client-urls="+etcdURL,
		"--listen-peer-urls=http://127.0.0.1:"+strconv.Itoa(ports[1]),
		"--initial-advertise-peer-urls=http://127.0.0.1:"+strconv.Itoa(ports[1]),
		"--initial-cluster=default=http://127.0.0.1:"+strconv.Itoa(ports[1]),
		// A test cluster lives for seconds: durability buys nothing.
		"--unsafe-no-fsync",
		"--log-level=warn",
	)
	s.apiArgs = []string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(s.port),
		"--tls-cert-file=" + certFile,
		"--tls-private-key-file=" + keyFile,
		"--cert-dir=" + filepath.Join(s.dir, "certs"),
		"--token-auth-file=" + s.writeFile("tokens.csv", adminToken+",admin,admin,\"system:masters\"\n"),
		"--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file=" + saKey,
		"--service-account-signing-key-file=" + saKey,
		"--service-cluster-ip-range=10.0.0.0/24",
		// The endpoint reconciler refuses a loopback advertise address,
		// and nothing here needs the kubernetes Service's endpoints.
		"--endpoint-reconciler-type=none",
		// No controller manager runs: the ServiceAccount admission plugin
		// would wait for token controllers that never come.
		"--disable-admission-plugins=ServiceAccount",
		"--allow-privileged=true",
		"--etcd-compaction-interval=" + cmp.Or(opts.CompactEvery, 5*time.Minute).String(),
		"-v=0",
	}
	s.startAPI()
	return s
}

// Config is an admin client configuration that dials into the server's
// namespace from wherever the test runs.
func (s *Server) Config() *rest.Config {
	return s.config(adminToken)
}

func (s *Server) config(token string) *rest.Config {
	return &rest.Config{
		Host:            s.url,
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAData: s.caPEM},
		Dial:            s.dial,
		QPS:             1000,
		Burst:           1000,
	}
}

// Clients returns typed and dynamic admin clients.
func (s *Server) Clients() (*kubernetes.Clientset, dynamic.Interface) {
	s.tb.Helper()
	cfg := s.Config()
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		s.tb.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		s.tb.Fatal(err)
	}
	return cs, dyn
}

// WriteKubeconfig writes a kubeconfig for token (an admin one when empty)
// into the server's directory and returns its path. It is meant for a
// process that runs inside Options.Netns.
func (s *Server) WriteKubeconfig(name, token string) string {
	s.tb.Helper()
	if token == "" {
		token = adminToken
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["test"] = &clientcmdapi.Cluster{Server: s.url, CertificateAuthorityData: s.caPEM}
	cfg.AuthInfos["test"] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: "test"}
	cfg.CurrentContext = "test"
	path := filepath.Join(s.dir, name)
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		s.tb.Fatal(err)
	}
	return path
}

// StopAPI stops the API server (etcd keeps running), as an upgrade or a
// crash of the control plane would.
func (s *Server) StopAPI() {
	s.tb.Helper()
	stopProcess(s.api)
	s.api = nil
}

// StartAPI starts the API server again after StopAPI, on the same port.
func (s *Server) StartAPI() {
	s.tb.Helper()
	s.startAPI()
}

func (s *Server) startAPI() {
	s.api = s.start(filepath.Join(s.tools, "kube-apiserver"), s.apiArgs...)
	s.waitReady()
}

// waitReady polls /readyz until the server answers ok. A cold start
// (bootstrap RBAC roles, system namespaces) takes a few seconds.
func (s *Server) waitReady() {
	tr := &http.Transport{
		DialContext:     func(ctx context.Context, network, addr string) (net.Conn, error) { return s.dial(ctx, network, addr) },
		TLSClientConfig: &tls.Config{RootCAs: s.caPool()},
	}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 2 * time.Second}
	deadline := time.Now().Add(60 * time.Second)
	var last error
	for time.Now().Before(deadline) {
		if s.api.exited() {
			break
		}
		req, _ := http.NewRequest(http.MethodGet, s.url+"/readyz", nil)
		req.Header.Set("Authorization", "Bearer "+adminToken)
		resp, err := client.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
			err = fmt.Errorf("readyz: %s", resp.Status)
		}
		last = err
		time.Sleep(100 * time.Millisecond)
	}
	s.tb.Fatalf("kube-apiserver not ready: %v (its log follows)", last)
}

// dial connects from inside the server's namespace: a socket keeps the
// namespace it was created in, so only the connect needs to happen there.
func (s *Server) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var conn net.Conn
	err := s.netns.Do(func(ns.NetNS) error {
		var d net.Dialer
		var err error
		conn, err = d.DialContext(ctx, network, addr)
		return err
	})
	return conn, err
}

// process is a started server; done is closed when it has exited.
type process struct {
	cmd  *exec.Cmd
	done chan struct{}
}

func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// start runs a server process inside the namespace; its output goes to the
// shared log, which a failing test prints.
func (s *Server) start(bin string, args ...string) *process {
	s.tb.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = s.logs, s.logs
	// Killed with the test binary, even when it dies without cleanup.
	// Pdeathsig follows the thread that forked, not the process: the
	// goroutine below keeps that thread locked until the server exits, so
	// the Go runtime cannot retire it under a live server.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	p := &process{cmd: cmd, done: make(chan struct{})}
	started := make(chan error, 1)
	go func() {
		// Never unlocked: the thread enters the namespace and is thrown
		// away with the goroutine.
		runtime.LockOSThread()
		if err := s.netns.Set(); err != nil {
			started <- fmt.Errorf("enter the namespace: %w", err)
			return
		}
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		cmd.Wait() //nolint:errcheck // a dead server shows in the log
		close(p.done)
	}()
	if err := <-started; err != nil {
		s.tb.Fatalf("start %s: %v", bin, err)
	}
	return p
}

func (s *Server) stop() {
	stopProcess(s.api)
	stopProcess(s.etcd)
	if s.tb.Failed() {
		s.tb.Logf("kube-apiserver and etcd log (tail):\n%s", s.logTail())
	}
	s.logs.Close()
}

// stopProcess ends a server with SIGTERM, and SIGKILL if it lingers.
func stopProcess(p *process) {
	if p == nil {
		return
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return
	case <-time.After(5 * time.Second):
	}
	p.cmd.Process.Kill()
	<-p.done
}

func (s *Server) logTail() string {
	data, _ := os.ReadFile(s.logs.Name())
	const max = 4000
	if len(data) > max {
		data = data[len(data)-max:]
	}
	return string(data)
}

// freePorts asks the namespace's kernel for n unused TCP ports.
func (s *Server) freePorts(n int) []int {
	s.tb.Helper()
	var ports []int
	err := s.netns.Do(func(ns.NetNS) error {
		var ls []net.Listener
		defer func() {
			for _, l := range ls {
				l.Close()
			}
		}()
		for range n {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				return err
			}
			ls = append(ls, l)
			ports = append(ports, l.Addr().(*net.TCPAddr).Port)
		}
		return nil
	})
	if err != nil {
		s.tb.Fatal(err)
	}
	return ports
}

// writeCredentials makes a self-signed serving certificate for 127.0.0.1
// (which clients also trust as the CA) and a service-account signing key.
func (s *Server) writeCredentials() (certFile, keyFile, saKeyFile string) {
	s.tb.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		s.tb.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "podfence-test-apiserver"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:              []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		s.tb.Fatal(err)
	}
	s.caPEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	certFile = s.writeFile("apiserver.crt", string(s.caPEM))
	keyFile = s.writeFile("apiserver.key", string(ecKeyPEM(s.tb, key)))

	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		s.tb.Fatal(err)
	}
	saKeyFile = s.writeFile("sa.key", string(ecKeyPEM(s.tb, saKey)))
	return certFile, keyFile, saKeyFile
}

func (s *Server) caPool() *x509.CertPool {
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(s.caPEM)
	return pool
}

func ecKeyPEM(tb testing.TB, key *ecdsa.PrivateKey) []byte {
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		tb.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})
}

func (s *Server) writeFile(name, content string) string {
	s.tb.Helper()
	path := filepath.Join(s.dir, name)
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		s.tb.Fatal(err)
	}
	return path
}
