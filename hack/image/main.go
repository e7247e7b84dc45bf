// Command image writes podfence's container image: the two static binaries
// under /usr/local/bin on an empty base (package ociimage), whose
// entrypoint is the sweeper's run, the DaemonSet's container.
//
//	go run ./hack/image -o bin/podfence-image.tar -ref ghcr.io/podfence/podfence:latest bin/podfence bin/podfence-sweeper
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"runtime"

	"github.com/podfence/podfence/pkg/ociimage"
)

// binDir is where the manifests in conf/ expect the binaries; install-cni
// finds podfence beside podfence-sweeper.
const binDir = "/usr/local/bin"

func main() {
	out := flag.String("o", "", "the image tarball to write (required)")
	ref := flag.String("ref", "ghcr.io/podfence/podfence:latest", "the image reference recorded in the tarball")
	arch := flag.String("arch", runtime.GOARCH, "the binaries' architecture (amd64 or arm64)")
	flag.Parse()
	if err := run(*out, *ref, *arch, flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}

func run(out, ref, arch string, bins []string) error {
	if out == "" || len(bins) == 0 {
		return errors.New("usage: image -o FILE [-ref REF] [-arch ARCH] BINARY...")
	}
	files := map[string]string{}
	for _, b := range bins {
		files[path.Join(binDir, filepath.Base(b))] = b
	}
	digest, err := ociimage.Write(out, ociimage.Spec{
		Ref: ref, Arch: arch, Files: files,
		Entrypoint: []string{path.Join(binDir, "podfence-sweeper")},
		Cmd:        []string{"run"},
		Labels:     map[string]string{"org.opencontainers.image.source": "https://github.com/podfence/podfence"},
	})
	if err != nil {
		return err
	}
	fmt.Printf("%s %s %s\n", out, ref, digest)
	return nil
}
