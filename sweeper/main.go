// Command podfence-sweeper is podfence's node agent and inspection tool.
// As a DaemonSet (run) it keeps the eBPF conntrack maps in step with the
// kernel's conntrack table and removes what pods that vanished without a
// DEL left behind; as a command it shows what the node is doing.
//
//	podfence-sweeper run            the DaemonSet loop: passes, destroy events, metrics
//	podfence-sweeper sweep          one pass; prints what it kept and deleted, and why
//	podfence-sweeper ls             identifiers, members, veths, programs, counters
//	podfence-sweeper dump conntrack the eBPF conntrack entries, with their owners
//	podfence-sweeper upgrade        move the node's pins and pods onto this build's datapath
//
// Every command takes --pin-root (default /sys/fs/bpf/podfence) and --json.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/pinroot"
	"github.com/podfence/podfence/pkg/sweep"
)

const usage = `usage: podfence-sweeper <command> [flags]

commands:
  run              the DaemonSet loop: reconcile, follow destroy events, serve metrics
  sweep            one reconciliation pass; prints what it kept and deleted, and why
  apply            program every identifier with the policy directory, once
  install-cni      install the podfence plugin and chain it last in the node's conflist
  uninstall-cni    take podfence out of the conflist and remove its binary
  adopt            fence the running pods podfence's ADD never saw, once (run --adopt does it continuously)
  uninstall        take podfence off the node: out of the chain, its hooks off every veth, its pins
  aws-agent        what the AWS network-policy agent left on the node (--remove takes it off)
  ls               identifiers, their members and host veths, programs, counters
  dump conntrack   the eBPF conntrack entries, with owner pod, peer, age and flags
  trace            denied packets as the datapath reports them, with pod, reason and policy
  why              what the datapath decides for a connection of a pod, why, and which rule
  upgrade          move the node's pins and pods onto this build's datapath (run does it at start)

Run "podfence-sweeper <command> -h" for a command's flags.
`

func main() {
	os.Exit(runMain(os.Args[1:], os.Stdout, os.Stderr))
}

// runMain is main with its streams, for tests: 0 success, 1 failure, 2 usage.
func runMain(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	args = hoistFlags(args)
	var err error
	switch cmd, rest := args[0], args[1:]; cmd {
	case "run":
		err = cmdRun(rest, stdout, stderr)
	case "sweep":
		err = cmdSweep(rest, stdout, stderr)
	case "ls":
		err = cmdLs(rest, stdout, stderr)
	case "apply":
		err = cmdApply(rest, stdout, stderr)
	case "trace":
		err = cmdTrace(rest, stdout, stderr)
	case "why":
		err = cmdWhy(rest, stdout, stderr)
	case "upgrade":
		err = cmdUpgrade(rest, stdout, stderr)
	case "install-cni":
		err = cmdInstallCNI(rest, stdout, stderr)
	case "adopt":
		err = cmdAdopt(rest, stdout, stderr)
	case "aws-agent":
		err = cmdAWSAgent(rest, stdout, stderr)
	case "uninstall":
		err = cmdUninstall(rest, stdout, stderr)
	case "uninstall-cni":
		err = cmdUninstallCNI(rest, stdout, stderr)
	case "dump":
		i := slices.Index(rest, "conntrack")
		if i < 0 {
			fmt.Fprintf(stderr, "podfence-sweeper dump: say what to dump: dump conntrack\n")
			return 2
		}
		err = cmdDumpConntrack(slices.Delete(slices.Clone(rest), i, i+1), stdout, stderr)
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage)
		return 0
	default:
		fmt.Fprintf(stderr, "podfence-sweeper: unknown command %q\n\n%s", cmd, usage)
		return 2
	}
	var ue usageError
	switch {
	case err == nil:
		return 0
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, &ue):
		fmt.Fprintf(stderr, "podfence-sweeper %s: %v\n", args[0], ue.err)
		return 2
	default:
		fmt.Fprintf(stderr, "podfence-sweeper %s: %v\n", args[0], err)
		return 1
	}
}

// usageError is a bad command line (exit status 2).
type usageError struct{ err error }

func (u usageError) Error() string { return u.err.Error() }

// common are the flags every command takes.
type common struct {
	pinRoot     string
	json        bool
	ctV4, ctV6  uint
	grace       time.Duration
	orphanGrace time.Duration
}

func newFlags(name string, stderr io.Writer, c *common, sweepFlags bool) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.pinRoot, "pin-root", pinpath.DefaultRoot, "bpffs directory of podfence's pins (the plugin's pinRoot)")
	fs.BoolVar(&c.json, "json", false, "machine-readable output")
	fs.UintVar(&c.ctV4, "ct-v4-entries", bpf.DefaultCTv4Entries, "capacity of the IPv4 conntrack map: the plugin's ctV4Entries")
	fs.UintVar(&c.ctV6, "ct-v6-entries", bpf.DefaultCTv6Entries, "capacity of the IPv6 conntrack map: the plugin's ctV6Entries")
	if sweepFlags {
		fs.DurationVar(&c.grace, "grace", sweep.DefaultGrace, "keep an entry seen this recently, whatever the kernel table says (0: none; a new flow's entry may then go before its kernel flow exists)")
		fs.DurationVar(&c.orphanGrace, "orphan-grace", sweep.DefaultOrphanGrace, "remove a member once its veth has been gone this long (0: at once)")
	}
	return fs
}

// warnGrace says what --grace 0 risks, which the user may mean.
func (c *common) warnGrace(stderr io.Writer) {
	if c.grace == 0 {
		fmt.Fprintln(stderr, "warning: --grace 0: a new flow's entry may be deleted before netfilter creates its kernel flow; its next packet is then judged again by policy")
	}
}

// parse parses args, refusing positional arguments.
func parse(fs *flag.FlagSet, args []string) error {
	rest, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(rest) > 0 {
		return usageError{fmt.Errorf("unexpected arguments %q", rest)}
	}
	return nil
}

// checkCommon refuses values of the common flags that the user set and
// that mean nothing: a conntrack size of 0 (which bpf.GlobalOptions would
// take for its default) or out of range, a negative grace.
func checkCommon(fs *flag.FlagSet) error {
	var err error
	fs.Visit(func(f *flag.Flag) {
		if err != nil {
			return
		}
		switch v := f.Value.(flag.Getter).Get().(type) {
		case uint:
			if strings.HasPrefix(f.Name, "ct-") && (v < bpf.MinCTEntries || v > bpf.MaxCTEntries) {
				err = fmt.Errorf("--%s %d: conntrack table size must be in [%d, %d]", f.Name, v, bpf.MinCTEntries, bpf.MaxCTEntries)
			}
		case time.Duration:
			if strings.HasSuffix(f.Name, "grace") && v < 0 {
				err = fmt.Errorf("--%s %v: need 0 or more", f.Name, v)
			}
		}
	})
	if err != nil {
		return usageError{err}
	}
	return nil
}

// parseInterspersed parses flags anywhere among args, as kubectl does, and
// returns the positional arguments in order; "--" ends the flags. Values a
// user set are checked where they are used, never replaced by a default.
func parseInterspersed(fs *flag.FlagSet, args []string) (positional []string, err error) {
	defer func() {
		if err == nil {
			err = checkCommon(fs)
		}
	}()
	var after []string
	if i := slices.Index(args, "--"); i >= 0 {
		args, after = args[:i], args[i+1:]
	}
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
			}
			return nil, usageError{err}
		}
		// Parse stops at the first positional argument.
		if args = fs.Args(); len(args) == 0 {
			return append(positional, after...), nil
		}
		positional = append(positional, args[0])
		args = args[1:]
	}
}

// hoistFlags moves the flags before a command to after its words, so that
// "podfence-sweeper --pin-root X sweep" is "sweep --pin-root X". A flag
// takes the next word as its value unless it is written --flag=value or is
// one of the boolean flags.
func hoistFlags(args []string) []string {
	var leading []string
	i := 0
	for i < len(args) && strings.HasPrefix(args[i], "-") && args[i] != "-" && args[i] != "--" {
		arg := args[i]
		leading = append(leading, arg)
		i++
		name := strings.TrimLeft(arg, "-")
		if strings.Contains(name, "=") || booleanFlags[name] || i >= len(args) || commands[args[i]] {
			continue
		}
		leading = append(leading, args[i])
		i++
	}
	if len(leading) == 0 || i >= len(args) {
		return args
	}
	out := []string{args[i]}
	words := 1
	if args[i] == "dump" && i+1 < len(args) {
		words = 2 // dump conntrack
	}
	out = append(out, args[i+1:i+words]...)
	out = append(out, leading...)
	return append(out, args[i+words:]...)
}

// booleanFlags are the flags of any command that take no value.
var booleanFlags = map[string]bool{"json": true, "h": true, "help": true, "keep-chained": true, "adopt": true, "remove": true}

// commands are the first words runMain knows.
var commands = map[string]bool{"run": true, "sweep": true, "ls": true, "apply": true, "trace": true, "why": true,
	"upgrade": true, "install-cni": true, "uninstall-cni": true, "uninstall": true, "aws-agent": true, "adopt": true, "dump": true}

func (c *common) globalOptions() (bpf.GlobalOptions, error) {
	for flag, n := range map[string]uint{"--ct-v4-entries": c.ctV4, "--ct-v6-entries": c.ctV6} {
		if n > bpf.MaxCTEntries {
			return bpf.GlobalOptions{}, usageError{fmt.Errorf("%s: conntrack table size %d is above %d", flag, n, bpf.MaxCTEntries)}
		}
		if err := bpf.CheckCTEntries(uint32(n)); err != nil {
			return bpf.GlobalOptions{}, usageError{fmt.Errorf("%s: %w", flag, err)}
		}
	}
	return bpf.GlobalOptions{CTv4Entries: uint32(c.ctV4), CTv6Entries: uint32(c.ctV6)}, nil
}

// How a command opens the pin root.
type rootUse uint8

const (
	// records: the pin root must exist; the node-wide maps are not
	// needed (ls reads the identifiers and their records).
	records rootUse = iota
	// inspect: the maps must exist, and pins of an earlier layout are
	// refused rather than taken over, so that a newer tool run on a node
	// does not upgrade it.
	inspect
	// upgrade: the maps must exist; pins of an earlier layout are taken over.
	upgrade
	// serve: run's and adopt's, which also make the pin root and the maps
	// on a node without them (the sweeper may start before its first pod).
	serve
)

// openRoot opens the pin root for a command's use, with the node-wide maps
// open already unless the use is records, so that a node without them is
// refused at once with what to do about it.
func openRoot(c *common, use rootUse) (*pinroot.Root, error) {
	opts, err := c.globalOptions()
	if err != nil {
		return nil, err
	}
	opts.KeepLayout = use == inspect || use == records
	root, err := pinroot.Open(c.pinRoot, pinroot.Options{Create: use == serve, Global: opts})
	if errors.Is(err, pinroot.ErrNoPinRoot) {
		return nil, fmt.Errorf("%w: no pod has been added on this node, or --pin-root differs from the plugin's pinRoot", err)
	}
	if err != nil {
		return nil, err
	}
	if use != records {
		if _, err := root.Global(); err != nil {
			return nil, err
		}
	}
	return root, nil
}

// defaultPolicyDir is the plugin's default policyDir.
const defaultPolicyDir = "/etc/podfence/policies"
