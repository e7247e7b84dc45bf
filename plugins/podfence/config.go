package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"sort"
	"strings"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/attach"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/policy"
)

// Defaults of the optional settings.
const (
	defaultPinRoot   = pinpath.DefaultRoot
	defaultPolicyDir = "/etc/podfence/policies"
)

// PluginConf is podfence's configuration in a conflist, chained after the
// primary plugin:
//
//	{"type": "podfence", "enforcingMode": "strict"}
//
// Every key is optional; an unknown key is an error, so that a typo does not
// silently leave a default in force.
type PluginConf struct {
	types.PluginConf

	// PinRoot is the bpffs directory of podfence's pins.
	PinRoot string `json:"pinRoot,omitempty"`
	// PolicyDir holds PolicyEndpoint documents (*.yaml, *.yml, *.json).
	PolicyDir string `json:"policyDir,omitempty"`
	// EnforcingMode is "standard" (a pod no policy selects is open) or
	// "strict" (it is closed until a policy selects it).
	EnforcingMode string `json:"enforcingMode,omitempty"`
	// AttachMode is "auto" (TCX from Linux 6.6, else tc), "tcx" or "tc".
	AttachMode string `json:"attachMode,omitempty"`
	// LogFile receives one JSON line per call; empty means no log (stdout
	// carries the CNI result and stderr is the runtime's).
	LogFile string `json:"logFile,omitempty"`
	// LogLevel is "debug", "info" (default), "warn" or "error".
	LogLevel string `json:"logLevel,omitempty"`
	// CTv4Entries and CTv6Entries size the node's conntrack maps (default
	// 131072 and 65536). A node setting: every conflist on the node and the
	// sweeper's --ct-v4-entries/--ct-v6-entries must say the same, and pins
	// of another size are refused.
	CTv4Entries uint32 `json:"ctV4Entries,omitempty"`
	CTv6Entries uint32 `json:"ctV6Entries,omitempty"`
	// SourceCheck (default true) drops a packet that opens a flow from a
	// pod with a source address that is not the pod's own. false is for
	// nodes whose pods must send from other addresses (VPN or egress
	// gateways): any pod on them can then speak for another, the node
	// included, and pass the policies that allow what it pretends to be.
	SourceCheck *bool `json:"sourceCheck,omitempty"`

	mode       policy.Mode
	attachMode attach.Mode
	logLevel   slog.Level
}

// knownKeys are the keys a podfence configuration may have: the CNI
// runtime's and podfence's own.
var knownKeys = map[string]bool{
	"cniVersion": true, "name": true, "type": true, "capabilities": true, "ipam": true,
	"dns": true, "prevResult": true, "cni.dev/valid-attachments": true,
	"runtimeConfig": true, "args": true,
	"pinRoot": true, "policyDir": true, "enforcingMode": true, "attachMode": true,
	"logFile": true, "logLevel": true, "ctV4Entries": true, "ctV6Entries": true, "sourceCheck": true,
	// The name an earlier draft of the spec used; libcni's GC sends it
	// beside the current one (containernetworking/cni#1101).
	oldValidAttachmentsKey: true,
}

const oldValidAttachmentsKey = "cni.dev/attachments"

// parseConfig decodes and validates stdin. With needPrevResult (ADD, CHECK)
// a missing prevResult is an error; DEL and GC run without one.
func parseConfig(stdin []byte, needPrevResult bool) (*PluginConf, error) {
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(stdin, &raw); err != nil {
		return nil, configError("config is not a JSON object: %v", err)
	}
	var unknown []string
	for k := range raw {
		if !knownKeys[k] {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) > 0 {
		sort.Strings(unknown)
		return nil, configError("unknown config keys %s (podfence takes pinRoot, policyDir, enforcingMode, attachMode, logFile, logLevel, ctV4Entries, ctV6Entries, sourceCheck)", strings.Join(unknown, ", "))
	}

	// A key that is set means what it says: its zero value is not taken
	// for the default, which leaving the key out gives.
	for _, k := range []string{"pinRoot", "policyDir", "enforcingMode", "attachMode", "logLevel", "ctV4Entries", "ctV6Entries"} {
		if v, ok := raw[k]; ok && (string(v) == `""` || string(v) == "0") {
			return nil, configError("%s is %s: leave the key out for its default, or give a value", k, v)
		}
	}

	conf := &PluginConf{}
	dec := json.NewDecoder(bytes.NewReader(stdin))
	if err := dec.Decode(conf); err != nil {
		return nil, configError("decode config: %v", err)
	}
	if _, ok := raw["cni.dev/valid-attachments"]; !ok && raw[oldValidAttachmentsKey] != nil {
		// A runtime that sends only the old name: reading nothing would
		// have GC remove every member.
		if err := json.Unmarshal(raw[oldValidAttachmentsKey], &conf.ValidAttachments); err != nil {
			return nil, configError("decode config: %s: %v", oldValidAttachmentsKey, err)
		}
	}
	if conf.PinRoot == "" {
		conf.PinRoot = defaultPinRoot
	}
	if conf.PolicyDir == "" {
		conf.PolicyDir = defaultPolicyDir
	}
	if !strings.HasPrefix(conf.PinRoot, "/") {
		return nil, configError("pinRoot %q: must be an absolute path on bpffs", conf.PinRoot)
	}
	var err error
	if conf.mode, err = policy.ParseMode(conf.EnforcingMode); err != nil {
		return nil, configError("enforcingMode: %v", err)
	}
	if conf.attachMode, err = attach.ParseMode(conf.AttachMode); err != nil {
		return nil, configError("attachMode: %v", err)
	}
	if conf.logLevel, err = parseLogLevel(conf.LogLevel); err != nil {
		return nil, configError("logLevel: %v", err)
	}
	if err := bpf.CheckCTEntries(conf.CTv4Entries); err != nil {
		return nil, configError("ctV4Entries: %v", err)
	}
	if err := bpf.CheckCTEntries(conf.CTv6Entries); err != nil {
		return nil, configError("ctV6Entries: %v", err)
	}

	if conf.RawPrevResult != nil {
		if err := version.ParsePrevResult(&conf.PluginConf); err != nil {
			return nil, configError("prevResult: %v", err)
		}
	}
	if needPrevResult && conf.PrevResult == nil {
		return nil, configError("no prevResult: podfence must be chained after a plugin that creates the pod's interface (e.g. aws-cni or ptp)")
	}
	return conf, nil
}

// sourceCheck is SourceCheck with its default.
func (c *PluginConf) sourceCheck() bool {
	return c.SourceCheck == nil || *c.SourceCheck
}

func parseLogLevel(s string) (slog.Level, error) {
	switch s {
	case "", "info":
		return slog.LevelInfo, nil
	case "debug":
		return slog.LevelDebug, nil
	case "warn":
		return slog.LevelWarn, nil
	case "error":
		return slog.LevelError, nil
	}
	return 0, fmt.Errorf("%q: must be debug, info, warn or error", s)
}

func configError(format string, args ...any) *types.Error {
	return types.NewError(types.ErrInvalidNetworkConfig, fmt.Sprintf(format, args...), "")
}
