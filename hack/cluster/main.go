// Command cluster runs the real node of package test/node for people and
// other tools (make cluster, make cluster-down), with podfence installed
// from its image and manifest.
//
//	go run ./hack/cluster up   -tools DIR -cni-bin DIR -image bin/podfence-image.tar
//	go run ./hack/cluster down
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/podfence/podfence/test/node"
)

func main() {
	node.MaybeSupervise()
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: cluster up|down [flags]")
		os.Exit(2)
	}
	cache := os.Getenv("PODFENCE_CACHE")
	if cache == "" {
		home, _ := os.UserHomeDir()
		cache = filepath.Join(home, ".cache", "podfence")
	}
	fs := flag.NewFlagSet(os.Args[1], flag.ExitOnError)
	state := fs.String("state", filepath.Join(cache, "node"), "the node's state directory")
	tools := fs.String("tools", os.Getenv("PODFENCE_K8S_TOOLS"), "hack/k8s-tools.sh's directory")
	cniBin := fs.String("cni-bin", "", "directory of ptp, host-local, portmap and loopback")
	image := fs.String("image", "bin/podfence-image.tar", "podfence's image archive (make image)")
	manifest := fs.String("manifest", "conf/podfence-sweeper.yaml", "podfence's DaemonSet manifest")
	port := fs.Int("port", 0, "the root namespace's loopback port of the API server (0: any)")
	fs.Parse(os.Args[2:])
	var err error
	switch os.Args[1] {
	case "up":
		err = up(*state, *tools, *cniBin, *image, *manifest, *port)
	case "down":
		var n *node.Node
		if n, err = node.Attach(*state); err == nil {
			err = n.Down()
		}
		if err == nil {
			err = os.RemoveAll(*state)
		}
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "cluster:", err)
		os.Exit(1)
	}
}

func up(state, tools, cniBin, image, manifestPath string, port int) error {
	manifest, err := os.ReadFile(manifestPath)
	if err != nil {
		return err
	}
	n, err := node.Up(node.Options{State: state, Tools: tools, CNIBin: cniBin, Images: []string{image}, ForwardPort: port})
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "node up; installing podfence (%s)\n", node.SweeperManifestChange)
	if err := n.InstallPodfence(manifest); err != nil {
		return fmt.Errorf("%w (the node runs: make cluster-down removes it)", err)
	}
	fmt.Printf(`The node runs (state: %s, logs: %s).
From this namespace:  export KUBECONFIG=%s
Inside the node:      nsenter --net=/proc/%d/ns/net --mount=/proc/%d/ns/mnt -- CMD (kubeconfig %s)
Remove it:            make cluster-down
`, n.State, filepath.Join(n.State, "logs"), n.Kubeconfig, n.PID, n.PID, n.InnerKubeconfig)
	return nil
}
