// Package ociimage writes container images of static binaries as OCI
// image-layout archives, which `ctr images import` reads and `skopeo copy
// oci-archive:` pushes: no daemon, no registry, and the same files give the
// same digest (fixed timestamps, root-owned entries). make image writes
// podfence's with it, and the real-node tests the images no registry here
// serves (pause, agnhost, CoreDNS).
package ociimage

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"slices"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/podfence/podfence/pkg/atomicfile"
)

// Spec is one image: files copied into one layer on an empty base, and
// the process the image starts.
type Spec struct {
	Ref  string // the reference recorded in the archive, e.g. registry.k8s.io/pause:3.10.2
	Arch string // amd64 or arm64
	// Files maps a path in the image (absolute) to a file on this machine;
	// each is written executable.
	Files      map[string]string
	Entrypoint []string
	Cmd        []string
	Labels     map[string]string
}

// Write writes spec's image to out (atomically) and returns its digest.
func Write(out string, spec Spec) (v1.Hash, error) {
	tag, err := name.NewTag(spec.Ref)
	if err != nil {
		return v1.Hash{}, fmt.Errorf("image reference: %w", err)
	}
	if len(spec.Files) == 0 {
		return v1.Hash{}, errors.New("image without files")
	}
	layerTar, err := filesLayer(spec.Files)
	if err != nil {
		return v1.Hash{}, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return v1.Hash{}, err
	}
	base := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	img, err := mutate.AppendLayers(base, layer)
	if err != nil {
		return v1.Hash{}, err
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return v1.Hash{}, err
	}
	cfg = cfg.DeepCopy()
	cfg.OS, cfg.Architecture = "linux", spec.Arch
	cfg.Config.Entrypoint = spec.Entrypoint
	cfg.Config.Cmd = spec.Cmd
	cfg.Config.Labels = spec.Labels
	if img, err = mutate.ConfigFile(img, cfg); err != nil {
		return v1.Hash{}, err
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return v1.Hash{}, err
	}
	if err := writeArchive(out, tag, img); err != nil {
		return v1.Hash{}, fmt.Errorf("write %s: %w", out, err)
	}
	return img.Digest()
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
	return atomicfile.WriteFunc(out, atomicfile.Options{}, func(w io.Writer) error {
		tw := tar.NewWriter(w)
		if err := tw.AddFS(os.DirFS(dir)); err != nil {
			return err
		}
		return tw.Close()
	})
}

// filesLayer is a tar of files (image path -> source), with the
// directories above them, owned by root, at the epoch, in path order.
func filesLayer(files map[string]string) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	epoch := time.Unix(0, 0)
	dirs := map[string]bool{}
	var names []string
	for dst := range files {
		if !path.IsAbs(dst) {
			return nil, fmt.Errorf("image path %q is not absolute", dst)
		}
		names = append(names, dst)
		for d := path.Dir(dst); d != "/"; d = path.Dir(d) {
			dirs[d[1:]+"/"] = true
		}
	}
	var dirNames []string
	for d := range dirs {
		dirNames = append(dirNames, d)
	}
	// A directory before what it holds: sorted by path, "usr/" comes
	// before "usr/local/".
	slices.Sort(dirNames)
	for _, d := range dirNames {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d, Mode: 0o755, ModTime: epoch}); err != nil {
			return nil, err
		}
	}
	slices.Sort(names)
	for _, dst := range names {
		data, err := os.ReadFile(files[dst])
		if err != nil {
			return nil, err
		}
		h := &tar.Header{Typeflag: tar.TypeReg, Name: dst[1:], Mode: 0o755, Size: int64(len(data)), ModTime: epoch}
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
