package main

import (
	"flag"
	"fmt"
	"io"
	"log/slog"

	"github.com/podfence/podfence/pkg/awsagent"
)

// cmdAWSAgent reports what the upstream AWS node agent left on the node
// (package awsagent), and removes it with --remove.
func cmdAWSAgent(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("aws-agent", flag.ContinueOnError)
	fs.SetOutput(stderr)
	pinDir := fs.String("aws-pin-dir", awsagent.DefaultPinDir, "where the AWS agent pinned its programs and maps")
	remove := fs.Bool("remove", false, "take the agent's filters off the veths and remove its pins")
	if err := parse(fs, args); err != nil {
		return err
	}
	l, err := awsagent.Find(*pinDir)
	if err != nil {
		return err
	}
	for _, f := range l.Filters {
		fmt.Fprintf(stdout, "filter %s on %s (ifindex %d) %s\n", f.Name, f.Link, f.Ifindex, f.Hook)
	}
	for _, p := range l.Pins {
		fmt.Fprintf(stdout, "pin %s\n", p)
	}
	if l.Empty() {
		fmt.Fprintln(stdout, "nothing of the AWS network-policy agent is left on this node")
		return nil
	}
	if !*remove {
		fmt.Fprintf(stdout, "%d filters and %d pins of the AWS network-policy agent: its filters keep enforcing the rules it last had; --remove takes them off\n", len(l.Filters), len(l.Pins))
		return nil
	}
	if err := awsagent.Remove(l, *pinDir); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "removed %d filters and %d pins of the AWS network-policy agent\n", len(l.Filters), len(l.Pins))
	return nil
}

// warnAWSAgent logs, at the sweeper's start, what the AWS agent left.
func warnAWSAgent(log *slog.Logger) {
	l, err := awsagent.Find(awsagent.DefaultPinDir)
	if err != nil {
		log.Debug("cannot look for the AWS network-policy agent's leftovers", "error", err)
		return
	}
	if !l.Empty() {
		log.Warn("the AWS network-policy agent left filters on pods' veths that keep enforcing the rules it last had, beside podfence; podfence-sweeper aws-agent --remove takes them off",
			"filters", len(l.Filters), "pins", len(l.Pins))
	}
}
