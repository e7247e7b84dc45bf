package main

import (
	"log/slog"
	"os"
	"time"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/podfence/podfence/pkg/podid"
)

// call is one plugin invocation, logged as one line when it ends.
type call struct {
	log       *slog.Logger
	cmd       string
	container string
	ifname    string
	start     time.Time

	id     podid.ID
	veth   string
	action string
}

// startCall opens the log. Logging never fails a call: without a writable
// logFile the line is dropped (stdout carries the CNI result).
func startCall(conf *PluginConf, cmd string, args *skel.CmdArgs) *call {
	c := &call{cmd: cmd, container: args.ContainerID, ifname: args.IfName, start: time.Now()}
	if conf.LogFile != "" {
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
	if err != nil {
		c.log.Error("podfence "+c.cmd+" failed", append(attrs, "error", err.Error())...)
		return
	}
	c.log.Info("podfence "+c.cmd, attrs...)
}
