// Command image writes podfence's container image: the two static binaries
// under /usr/local/bin on an empty base, with OCI media types, as a tar of
// an OCI image layout that `ctr images import` reads and `skopeo copy
// oci-archive:` pushes. No daemon is involved, and the same binaries give
// the same image digest (fixed timestamps).
//
//	go run ./hack/image -o bin/podfence-image.tar -ref ghcr.io/podfence/podfence:latest bin/podfence bin/podfence-sweeper
package main

import (
	"archive/tar"
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
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
	tag, err := name.NewTag(ref)
	if err != nil {
		return fmt.Errorf("-ref: %w", err)
	}
	layerTar, err := binaryLayer(bins)
	if err != nil {
		return err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return err
	}
	base := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	img, err := mutate.AppendLayers(base, layer)
	if err != nil {
		return err
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return err
	}
	cfg = cfg.DeepCopy()
	cfg.OS, cfg.Architecture = "linux", arch
	cfg.Config.Entrypoint = []string{path.Join(binDir, "podfence-sweeper")}
	cfg.Config.Cmd = []string{"run"}
	cfg.Config.Labels = map[string]string{"org.opencontainers.image.source": "https://github.com/podfence/podfence"}
	if img, err = mutate.ConfigFile(img, cfg); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return err
	}
	if err := writeArchive(out, tag, img); err != nil {
		return fmt.Errorf("write %s: %w", out, err)
	}
	digest, err := img.Digest()
	if err != nil {
		return err
	}
	fmt.Printf("%s %s %s\n", out, tag, digest)
	return nil
}

// writeArchive writes img as an OCI image layout in a tar. The index names
// it twice: containerd reads io.containerd.image.name, other tools the OCI
// ref.name annotation.
func writeArchive(out string, tag name.Tag, img v1.Image) error {
	dir, err := os.MkdirTemp("", "podfence-image")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	l, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	if err := l.AppendImage(img, layout.WithAnnotations(map[string]string{
		"io.containerd.image.name":          tag.Name(),
		"org.opencontainers.image.ref.name": tag.Name(),
	})); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(out), ".image-*")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	tw := tar.NewWriter(f)
	err = tw.AddFS(os.DirFS(dir))
	if err == nil {
		err = tw.Close()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	return os.Rename(f.Name(), out)
}

// binaryLayer is a tar of bins under binDir, with the directories above
// them, owned by root, at the epoch.
func binaryLayer(bins []string) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	epoch := time.Unix(0, 0)
	for _, dir := range []string{"usr/", "usr/local/", "usr/local/bin/"} {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: dir, Mode: 0o755, ModTime: epoch}); err != nil {
			return nil, err
		}
	}
	for _, bin := range bins {
		data, err := os.ReadFile(bin)
		if err != nil {
			return nil, err
		}
		h := &tar.Header{Typeflag: tar.TypeReg, Name: path.Join(binDir[1:], filepath.Base(bin)), Mode: 0o755, Size: int64(len(data)), ModTime: epoch}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
