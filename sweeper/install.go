package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/podfence/podfence/pkg/atomicfile"
	"github.com/podfence/podfence/pkg/cniconf"
	"github.com/podfence/podfence/pkg/localhook"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/pinroot"
	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/pkg/uplink"
)

// cniFlags locate the node's CNI configuration and binaries.
type cniFlags struct {
	confDir, conflist, binDir string
}

func (c *cniFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&c.confDir, "cni-conf-dir", "/etc/cni/net.d", "the runtime's CNI configuration directory")
	fs.StringVar(&c.conflist, "conflist", "", "the conflist to change (default: the first *.conflist in --cni-conf-dir, the one the runtime uses)")
	fs.StringVar(&c.binDir, "cni-bin-dir", "/opt/cni/bin", "the runtime's CNI plugin directory")
}

// read returns the conflist's path and contents.
func (c *cniFlags) read() (string, []byte, error) {
	path := c.conflist
	if path == "" {
		var err error
		if path, err = cniconf.FindConflist(c.confDir); err != nil {
			return "", nil, err
		}
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return "", nil, fmt.Errorf("read conflist: %w", err)
	}
	return path, data, nil
}

// cmdInstallCNI installs the podfence binary into the plugin directory and
// chains it last in the node's conflist. It changes nothing when the
// conflist is malformed, and nothing at all on a second run.
func cmdInstallCNI(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("install-cni", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cf cniFlags
	cf.register(fs)
	plugin := fs.String("plugin", "", "the podfence binary to install (default: podfence beside this binary)")
	pinRoot := fs.String("pin-root", "/sys/fs/bpf/podfence", "pinRoot written into podfence's entry")
	policyDir := fs.String("policy-dir", defaultPolicyDir, "policyDir written into podfence's entry")
	mode := fs.String("enforcing-mode", "", "enforcingMode written into podfence's entry: standard or strict (empty: none, the plugin's default, standard)")
	if err := parse(fs, args); err != nil {
		return err
	}
	conf, err := podfenceEntry(*pinRoot, *policyDir, *mode)
	if err != nil {
		return err
	}
	bin, err := pluginBinary(*plugin)
	if err != nil {
		return err
	}
	res, err := ensureChained(cf, conf, bin, true)
	if err != nil {
		return err
	}
	if res.installed {
		fmt.Fprintf(stdout, "installed %s\n", filepath.Join(cf.binDir, cniconf.PluginType))
	}
	if res.chained {
		fmt.Fprintf(stdout, "chained podfence last in %s\n", res.conflist)
	} else {
		fmt.Fprintf(stdout, "%s already chains podfence last\n", res.conflist)
	}
	return nil
}

// podfenceEntry is podfence's conflist entry for these settings (mode
// empty: none, the plugin's default).
func podfenceEntry(pinRoot, policyDir, mode string) (map[string]any, error) {
	conf := map[string]any{"pinRoot": pinRoot, "policyDir": policyDir}
	if mode != "" {
		m, err := policy.ParseMode(mode)
		if err != nil {
			return nil, usageError{fmt.Errorf("--enforcing-mode: %w", err)}
		}
		conf["enforcingMode"] = string(m)
	}
	return conf, nil
}

// cmdUninstallCNI takes podfence out of the conflist, then removes its
// binary: the runtime stops calling it before it goes.
func cmdUninstallCNI(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("uninstall-cni", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cf cniFlags
	cf.register(fs)
	if err := parse(fs, args); err != nil {
		return err
	}
	return unchain(cf, stdout)
}

// unchain takes podfence out of the conflist, then removes its binary.
func unchain(cf cniFlags, stdout io.Writer) error {
	path, data, err := cf.read()
	if err != nil {
		return err
	}
	out, changed, err := cniconf.Unchain(data)
	if err != nil {
		return fmt.Errorf("%s: %w (left as it is)", path, err)
	}
	if changed {
		if err := atomicfile.Write(path, out, atomicfile.Options{Perm: 0o644, KeepMode: true, Sync: true}); err != nil {
			return fmt.Errorf("write %s: %w", path, err)
		}
		fmt.Fprintf(stdout, "removed podfence from %s\n", path)
	}
	dst := filepath.Join(cf.binDir, cniconf.PluginType)
	if err := os.Remove(dst); err == nil {
		fmt.Fprintf(stdout, "removed %s\n", dst)
	} else if !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove %s: %w", dst, err)
	}
	return nil
}

// cmdUninstall takes podfence off the node completely: out of the chain
// first (no new pod gets its hooks), then every member's hooks off its
// veth, then the pins. Pods keep running, no longer fenced. The DaemonSet
// goes first: its sweeper would put podfence back into the chain.
func cmdUninstall(args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlags("uninstall", stderr, &c, false)
	var cf cniFlags
	cf.register(fs)
	if err := parse(fs, args); err != nil {
		return err
	}
	// A conflist that cannot be read or changed does not keep the hooks
	// on: they come off, and the error is returned at the end.
	chainErr := unchain(cf, stdout)
	if chainErr != nil {
		fmt.Fprintf(stderr, "podfence-sweeper uninstall: %v; taking the hooks off anyway\n", chainErr)
	}
	pins := pinroot.At(c.pinRoot)
	// The uplinks' judge first: a legacy filter outlives the pins.
	if err := (uplink.Hooks{Dir: pinpath.Root(c.pinRoot).Uplinks()}).Release(); err != nil {
		return fmt.Errorf("uninstall: take the judge off the uplinks: %w (run it again to finish)", err)
	}
	if err := localhook.Release(pinpath.Root(c.pinRoot).LocalLink()); err != nil {
		return fmt.Errorf("uninstall: take the local judge off its cgroup: %w (run it again to finish)", err)
	}
	r, err := pins.RemoveAll()
	fmt.Fprintf(stdout, "took %d pods' hooks off their veths, removed %d identifiers\n", r.Members, r.Identifiers)
	if err != nil {
		return fmt.Errorf("uninstall: %w (run it again to finish)", err)
	}
	if len(r.Kept) > 0 {
		return fmt.Errorf("uninstall: identifiers %v kept: a member record podfence cannot read stands for hooks it does not know; see ls", r.Kept)
	}
	if err := pins.Remove(); err != nil {
		return errors.Join(chainErr, err)
	}
	fmt.Fprintf(stdout, "removed %s\n", c.pinRoot)
	return chainErr
}
