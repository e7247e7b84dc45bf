package main

import (
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/podid"
)

// call is one plugin invocation, logged as one line when it ends.
type call struct {
	log       *slog.Logger
	cmd       string
	container string
	ifname    string
	start     time.Time

	id       podid.ID
	veth     string
	action   string
	replaced string // pins this call replaced, and why
	renewed  string // pins of an earlier build this call took over
	// policy is what the documents selecting the pod say that is not
	// enforced as written (policy.Document.Report).
	policy []string

	last   time.Time
	phases []any // name, milliseconds, name, milliseconds...
}

// mark ends a phase of the call; finish logs how long each took.
func (c *call) mark(phase string) {
	now := time.Now()
	if c.last.IsZero() {
		c.last = c.start
	}
	c.phases = append(c.phases, slog.Float64(phase, float64(now.Sub(c.last).Microseconds())/1000))
	c.last = now
}

// startCall opens the log, making its directory on a node that has none
// yet. Logging never fails a call: without a writable logFile the line is
// dropped (stdout carries the CNI result).
func startCall(conf *PluginConf, cmd string, args *skel.CmdArgs) *call {
	c := &call{cmd: cmd, container: args.ContainerID, ifname: args.IfName, start: time.Now()}
	if conf.LogFile != "" {
		_ = os.MkdirAll(filepath.Dir(conf.LogFile), 0o750)
		if f, err := os.OpenFile(conf.LogFile, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o640); err == nil {
			c.log = slog.New(slog.NewJSONHandler(f, &slog.HandlerOptions{Level: conf.logLevel}))
		}
	}
	return c
}

func (c *call) finish(err error) {
	if c.log == nil {
		return
	}
	attrs := []any{
		"cmd", c.cmd, "container", c.container, "ifname", c.ifname,
		"identifier", string(c.id), "veth", c.veth, "action", c.action,
		"duration_ms", float64(time.Since(c.start).Microseconds()) / 1000,
	}
	// The call's CPU time, its threads' and the kernel's on its behalf,
	// from the process's start: what the call cost the node, whatever the
	// rest of the node kept the CPUs busy with meanwhile (the wall-clock
	// phases include that wait).
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &ru) == nil {
		attrs = append(attrs, "cpu_ms", float64(ru.Utime.Nano()+ru.Stime.Nano())/1e6)
	}
	if len(c.policy) > 0 {
		attrs = append(attrs, "policy_not_enforced_as_written", c.policy)
	}
	if c.renewed != "" {
		attrs = append(attrs, "renewed_pins", c.renewed)
	}
	if c.replaced != "" {
		attrs = append(attrs, "replaced_unused_pins", c.replaced)
	}
	if len(c.phases) > 0 {
		attrs = append(attrs, slog.Group("phases_ms", c.phases...))
	}
	if err != nil {
		c.log.Error("podfence "+c.cmd+" failed", append(attrs, "error", err.Error())...)
		return
	}
	c.log.Info("podfence "+c.cmd, attrs...)
}
