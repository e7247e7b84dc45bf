package podid

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
)

// ErrInvalid is wrapped by every error about a name that cannot become an
// identifier. Callers (the CNI plugin) map it to CNI error code 4.
var ErrInvalid = errors.New("invalid pod identity")

// ID is a pod identifier in its bpffs-safe form, e.g. "web-7f65cc6544@default".
// It never contains '/', '.', NUL or "..", so it can be used as one path
// element below a pin root.
type ID string

// Kubernetes builds generated name suffixes from this alphabet (no vowels, no
// digits that look like letters); see k8s.io/apimachinery/pkg/util/rand.
const generatedAlphabet = "bcdfghjklmnpqrstvwxz2456789"

// generatedSuffixLen is the length of the random suffix a ReplicaSet or
// DaemonSet controller appends to its pods' names.
const generatedSuffixLen = 5

// maxLen keeps an identifier plus the longest name podfence puts next to it
// well below NAME_MAX (255).
const maxLen = 200

// containerPrefix starts identifiers derived from a container ID. A pod name
// cannot start with '_', so these never collide with pod identifiers.
const containerPrefix = "_ctr@"

// FromPod derives the identifier shared by the replicas of a workload from a
// pod's name and namespace (K8S_POD_NAME, K8S_POD_NAMESPACE).
//
// The last '-' segment is stripped only when it has the shape of a generated
// suffix, so "web-7f65cc6544-9j58r" becomes "web-7f65cc6544" while "db-0" and
// bare pods keep their own name. Names that are not valid Kubernetes names
// are rejected with an error wrapping ErrInvalid.
func FromPod(name, namespace string) (ID, error) {
	if err := validateSubdomain(name); err != nil {
		return "", fmt.Errorf("pod name %q: %w", name, err)
	}
	if err := validateLabel(namespace); err != nil {
		return "", fmt.Errorf("pod namespace %q: %w", namespace, err)
	}
	return build(Workload(name), "@"+namespace), nil
}

// Workload returns the part of a pod name shared by its replicas: the name
// without a generated suffix. It assumes a valid name.
func Workload(name string) string {
	i := strings.LastIndexByte(name, '-')
	if i <= 0 || len(name)-i-1 != generatedSuffixLen {
		return name
	}
	for _, c := range name[i+1:] {
		if !strings.ContainsRune(generatedAlphabet, c) {
			return name
		}
	}
	return name[:i]
}

// FromContainerID derives an identifier for a container started without
// Kubernetes arguments (plain runtimes, cnitool): such a container shares
// nothing with others.
func FromContainerID(containerID string) (ID, error) {
	if containerID == "" || len(containerID) > 253 {
		return "", fmt.Errorf("container id %q: must be 1 to 253 characters: %w", containerID, ErrInvalid)
	}
	for _, c := range containerID {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return "", fmt.Errorf("container id %q: character %q not allowed (the CNI spec allows letters, digits, '-', '_' and '.'): %w", containerID, c, ErrInvalid)
		}
	}
	// '_' is allowed in container IDs, so '.' (refused by bpffs) becomes
	// '%', which is not.
	return build(containerPrefix+strings.ReplaceAll(containerID, ".", "%"), ""), nil
}

// build joins name and suffix, mapping '.' (refused by bpffs) to '_' (absent
// from Kubernetes names), which keeps the mapping injective. An over-long
// name is cut and followed by a hash of the whole, so distinct inputs stay
// distinct and the suffix ("@namespace") is kept.
func build(name, suffix string) ID {
	name = strings.ReplaceAll(name, ".", "_")
	if len(name)+len(suffix) > maxLen {
		sum := sha256.Sum256([]byte(name + suffix))
		name = name[:maxLen-len(suffix)-17] + "~" + hex.EncodeToString(sum[:8])
	}
	return ID(name + suffix)
}

// Valid reports whether s has the form of an identifier this package builds.
// The sweeper uses it to tell podfence's pin directories from anything else.
func Valid(s string) bool {
	if s == "" || len(s) > maxLen || !strings.Contains(s, "@") {
		return false
	}
	return !strings.ContainsAny(s, "/.\x00")
}

func (id ID) String() string { return string(id) }

// validateSubdomain checks a DNS-1123 subdomain (pod names): at most 253
// characters of lowercase alphanumerics, '-' and '.', each dot-separated
// label starting and ending with an alphanumeric.
func validateSubdomain(s string) error {
	if len(s) == 0 || len(s) > 253 {
		return fmt.Errorf("must be 1 to 253 characters: %w", ErrInvalid)
	}
	for _, label := range strings.Split(s, ".") {
		if err := checkLabelChars(label); err != nil {
			return err
		}
	}
	return nil
}

// validateLabel checks a DNS-1123 label (namespaces): at most 63 characters.
func validateLabel(s string) error {
	if len(s) == 0 || len(s) > 63 {
		return fmt.Errorf("must be 1 to 63 characters: %w", ErrInvalid)
	}
	return checkLabelChars(s)
}

func checkLabelChars(label string) error {
	if label == "" {
		return fmt.Errorf("empty label: %w", ErrInvalid)
	}
	for i := 0; i < len(label); i++ {
		c := label[i]
		alnum := c >= 'a' && c <= 'z' || c >= '0' && c <= '9'
		switch {
		case alnum:
		case c == '-' && i > 0 && i < len(label)-1:
		default:
			return fmt.Errorf("character %q at %d: only lowercase letters, digits and inner '-' are allowed: %w", c, i, ErrInvalid)
		}
	}
	return nil
}
