// Package cniconf chains podfence into a node's CNI network configuration
// list, and takes it out again, without touching anything else in it: the
// other plugins keep their bytes, the top-level fields their order, and
// the file is replaced atomically (a runtime reading it meanwhile sees the
// old list or the new one, never half of either).
package cniconf

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
)

// PluginType is podfence's "type" in a conflist.
const PluginType = "podfence"

// What an adoption (package adopt) and the plugin it runs say to each
// other beyond the CNI spec.
const (
	// AdoptionArg, set to "true" in CNI_ARGS, marks an ADD that adoption
	// runs for a sandbox the runtime reported ready, not the runtime's own.
	AdoptionArg = "PODFENCE_ADOPTION"
	// ErrCodeDeleted is the CNI error code of an adoption's ADD refused
	// because the container's DEL has run (package membership's
	// tombstones): the pod is going, and nothing was added for it.
	ErrCodeDeleted uint = 105
)

// ErrMalformed is wrapped when a conflist is not a JSON object with a
// "plugins" array of objects that each have a string "type".
var ErrMalformed = errors.New("malformed CNI conflist")

// ErrNoConflist is wrapped by FindConflist when the directory holds none:
// the primary CNI has not written its configuration yet.
var ErrNoConflist = errors.New("no .conflist")

// field is one top-level member, kept as its bytes.
type field struct {
	key string
	val json.RawMessage
}

// list is a parsed conflist: its top-level fields in file order, and the
// plugins array's elements.
type list struct {
	fields  []field
	plugins []json.RawMessage
	types   []string
}

func parse(data []byte) (*list, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, fmt.Errorf("%w: not a JSON object", ErrMalformed)
	}
	l := &list{}
	seen := false
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, fmt.Errorf("%w: %v", ErrMalformed, err)
		}
		key, _ := tok.(string)
		var val json.RawMessage
		if err := dec.Decode(&val); err != nil {
			return nil, fmt.Errorf("%w: field %q: %v", ErrMalformed, key, err)
		}
		if key == "plugins" {
			if seen {
				return nil, fmt.Errorf("%w: two \"plugins\" fields", ErrMalformed)
			}
			seen = true
			if err := json.Unmarshal(val, &l.plugins); err != nil {
				return nil, fmt.Errorf("%w: \"plugins\" is not an array", ErrMalformed)
			}
			for i, p := range l.plugins {
				var head struct {
					Type *string `json:"type"`
				}
				if err := json.Unmarshal(p, &head); err != nil || head.Type == nil || *head.Type == "" {
					return nil, fmt.Errorf("%w: plugin %d is not an object with a \"type\"", ErrMalformed, i)
				}
				l.types = append(l.types, *head.Type)
			}
		}
		l.fields = append(l.fields, field{key, val})
	}
	if _, err := dec.Token(); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrMalformed, err)
	}
	if dec.More() || dec.InputOffset() < int64(len(bytes.TrimRight(data, " \t\r\n"))) {
		return nil, fmt.Errorf("%w: trailing data after the object", ErrMalformed)
	}
	if !seen {
		return nil, fmt.Errorf("%w: no \"plugins\" array (a single-plugin .conf cannot be chained)", ErrMalformed)
	}
	return l, nil
}

func (l *list) marshal() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, f := range l.fields {
		if i > 0 {
			b.WriteByte(',')
		}
		k, _ := json.Marshal(f.key)
		b.Write(k)
		b.WriteByte(':')
		if f.key == "plugins" {
			b.WriteByte('[')
			for j, p := range l.plugins {
				if j > 0 {
					b.WriteByte(',')
				}
				b.Write(p)
			}
			b.WriteByte(']')
			continue
		}
		b.Write(f.val)
	}
	b.WriteByte('}')
	var out bytes.Buffer
	if err := json.Indent(&out, b.Bytes(), "", "  "); err != nil {
		return nil, err
	}
	out.WriteByte('\n')
	return out.Bytes(), nil
}

// Chain returns data with podfence as its last plugin: conf (podfence's
// own settings, without "type") appended when it is absent, an existing
// podfence entry moved to the end, unchanged, when it is not last. With
// podfence already last it returns data as it is. The second result says
// whether anything changed.
func Chain(data []byte, conf map[string]any) ([]byte, bool, error) {
	l, err := parse(data)
	if err != nil {
		return nil, false, err
	}
	idx := -1
	for i, t := range l.types {
		if t == PluginType {
			if idx >= 0 {
				return nil, false, fmt.Errorf("%w: podfence is in the list twice", ErrMalformed)
			}
			idx = i
		}
	}
	switch {
	case idx == len(l.plugins)-1:
		return data, false, nil
	case idx >= 0:
		p := l.plugins[idx]
		l.plugins = append(append(l.plugins[:idx:idx], l.plugins[idx+1:]...), p)
	default:
		entry := map[string]any{"type": PluginType}
		for k, v := range conf {
			entry[k] = v
		}
		raw, err := json.Marshal(entry)
		if err != nil {
			return nil, false, err
		}
		l.plugins = append(l.plugins, raw)
	}
	out, err := l.marshal()
	return out, true, err
}

// Unchain returns data without podfence; the second result says whether
// it was there.
func Unchain(data []byte) ([]byte, bool, error) {
	l, err := parse(data)
	if err != nil {
		return nil, false, err
	}
	kept := l.plugins[:0]
	for i, p := range l.plugins {
		if l.types[i] != PluginType {
			kept = append(kept, p)
		}
	}
	if len(kept) == len(l.types) {
		return data, false, nil
	}
	l.plugins = kept
	out, err := l.marshal()
	return out, true, err
}

// Entry returns podfence's settings in data (its entry without "type"),
// or nil when the list does not chain podfence.
func Entry(data []byte) (map[string]any, error) {
	l, err := parse(data)
	if err != nil {
		return nil, err
	}
	i := slices.Index(l.types, PluginType)
	if i < 0 {
		return nil, nil
	}
	var conf map[string]any
	dec := json.NewDecoder(bytes.NewReader(l.plugins[i]))
	dec.UseNumber() // numbers written back as they were read
	if err := dec.Decode(&conf); err != nil {
		return nil, fmt.Errorf("%w: podfence's entry: %v", ErrMalformed, err)
	}
	delete(conf, "type")
	return conf, nil
}

// FindConflist returns the conflist a runtime uses in dir: the first
// *.conflist by name (libcni reads .conf and .json too, but only a list
// can chain a plugin).
func FindConflist(dir string) (string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return "", fmt.Errorf("CNI config directory: %w", err)
	}
	var names []string
	for _, e := range entries {
		if !e.IsDir() && strings.HasSuffix(e.Name(), ".conflist") {
			names = append(names, e.Name())
		}
	}
	if len(names) == 0 {
		return "", fmt.Errorf("%w in %s: the primary CNI has not written its configuration yet", ErrNoConflist, dir)
	}
	sort.Strings(names)
	return filepath.Join(dir, names[0]), nil
}
