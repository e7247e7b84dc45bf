package attach

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/pkg/objinfo"
	"github.com/podfence/podfence/pkg/pinfs"
)

// Mode is the attach mechanism.
type Mode string

const (
	ModeAuto Mode = "auto" // TCX where the kernel has it, legacy TC otherwise
	ModeTCX  Mode = "tcx"  // pinned TCX link; requires Linux 6.6
	ModeTC   Mode = "tc"   // clsact qdisc and cls_bpf direct-action filter
)

// ParseMode parses the plugin's attachMode. Empty means ModeAuto.
func ParseMode(s string) (Mode, error) {
	switch Mode(s) {
	case "", ModeAuto:
		return ModeAuto, nil
	case ModeTCX, ModeTC:
		return Mode(s), nil
	}
	return "", fmt.Errorf("attach mode %q: must be %s, %s or %s", s, ModeAuto, ModeTCX, ModeTC)
}

// Resolve turns ModeAuto into ModeTCX or ModeTC for the running kernel.
// ModeTCX on a kernel without TCX is an error wrapping ErrTCXUnsupported;
// ModeTC is always possible (cls_bpf direct-action needs Linux 4.5).
func Resolve(m Mode) (Mode, error) {
	return resolve(m, TCXSupported)
}

// TCXRecord is the path of a record (a symlink, as pinfs writes records)
// of the TCX probe's answer, kept for the processes after this one: a
// kernel's features change only with a reboot, which also empties bpffs,
// where the record lives, while the probe takes the kernel's rtnl lock,
// for which a burst of pod starts queues (the probe took 66 to 150 ms of
// each ADD in TestChurn's bursts).
type TCXRecord string

// Resolve is the package's Resolve with the recorded answer, when the
// record has one. Otherwise it probes, and save says so: the caller saves
// the answer (Save) once its call has succeeded, so that a failed call
// leaves nothing behind.
func (r TCXRecord) Resolve(m Mode) (mode Mode, save bool, err error) {
	recorded := r.read()
	mode, err = resolve(m, func() error {
		if recorded != nil {
			return *recorded
		}
		save = true
		return TCXSupported()
	})
	return mode, save && err == nil, err
}

// Save records the probe's answer (probing if this process has not). A
// record that cannot be written costs the next process the probe, nothing
// more: its error is for the log.
func (r TCXRecord) Save() error {
	err := TCXSupported()
	answer := recordTCX
	switch {
	case errors.Is(err, ErrTCXUnsupported):
		answer = recordNoTCX
	case err != nil:
		return err // the probe failed: nothing to record
	}
	if err := os.MkdirAll(filepath.Dir(string(r)), 0o700); err != nil {
		return fmt.Errorf("record the tcx probe: %w", err)
	}
	return pinfs.WriteRecord(string(r), answer)
}

// read is the recorded answer as TCXSupported gives it; nil without one.
func (r TCXRecord) read() *error {
	text, ok, err := pinfs.ReadRecord(string(r))
	if err != nil || !ok {
		return nil
	}
	var answer error
	switch text {
	case recordTCX:
	case recordNoTCX:
		answer = ErrTCXUnsupported
	default:
		return nil
	}
	return &answer
}

// Answers of the TCX probe as TCXRecord records them.
const (
	recordTCX   = "tcx"
	recordNoTCX = "no-tcx"
)

func resolve(m Mode, tcxSupported func() error) (Mode, error) {
	switch m {
	case ModeTC:
		return ModeTC, nil
	case ModeTCX:
		if err := tcxSupported(); err != nil {
			return "", fmt.Errorf("resolve attach mode %s: %w", m, err)
		}
		return ModeTCX, nil
	case "", ModeAuto:
		err := tcxSupported()
		switch {
		case err == nil:
			return ModeTCX, nil
		case errors.Is(err, ErrTCXUnsupported):
			return ModeTC, nil
		default:
			return "", fmt.Errorf("resolve attach mode %s: %w", ModeAuto, err)
		}
	}
	return "", fmt.Errorf("resolve attach mode %q: unknown mode", m)
}

// Hook is a TC hook of the host-side veth. Its direction is the veth's, which
// is the opposite of the pod's: the pod's egress program goes on HookIngress.
type Hook uint8

const (
	HookIngress Hook = iota // packets the pod sends
	HookEgress              // packets to the pod
)

func (h Hook) String() string {
	switch h {
	case HookIngress:
		return "ingress"
	case HookEgress:
		return "egress"
	}
	return "hook(" + strconv.Itoa(int(h)) + ")"
}

func (h Hook) valid() bool { return h == HookIngress || h == HookEgress }

// Options say where Attach puts a program and Detach looks for it.
type Options struct {
	// Ifindex is the interface index of the host veth, in the calling
	// thread's network namespace.
	Ifindex int
	// Hook is the TC hook of that veth.
	Hook Hook
	// Program is the SchedCLS program to attach. Required by Attach. Detach
	// uses it, when set, to leave a legacy filter alone that runs another
	// program (the ifindex was reused by another veth).
	Program *ebpf.Program
	// Mode is the mechanism; ModeAuto (or empty) picks one for the kernel.
	Mode Mode
	// LinkPin is the bpffs path where a TCX link is pinned so it outlives
	// the process (the CNI plugin exits right after ADD). Required for TCX;
	// its directory is created when missing. One pin per veth and hook: it
	// names podfence's attachment there.
	LinkPin string
	// Name tags the cls_bpf filter (shown by `tc filter show`); default
	// "podfence".
	Name string
}

func (o *Options) check(op string) error {
	if o.Ifindex <= 0 {
		return fmt.Errorf("%s: invalid interface index %d", op, o.Ifindex)
	}
	if !o.Hook.valid() {
		return fmt.Errorf("%s on interface %d: invalid %s", op, o.Ifindex, o.Hook)
	}
	return nil
}

// Attach puts o.Program on the hook and returns the mode it used. It is
// idempotent: attaching the program that is already there changes nothing,
// and a different program replaces podfence's previous one atomically, so
// the hook is never without a podfence program in between.
//
// With TCX, the link pinned at o.LinkPin is updated; a pin whose link is
// severed (its veth was deleted) or belongs to another interface or hook is
// removed and a new link is made and pinned. With legacy TC, podfence's
// filter (fixed priority and handle) is replaced; the clsact qdisc is
// created when missing, and other qdiscs and filters are left alone.
//
// Whichever mechanism is used, a podfence attachment made on the same hook
// by the other one (after attachMode changed) is removed, so that exactly one
// podfence program runs there; the new one is in place before the old one
// goes.
//
// TCX requires Linux 6.6 (ModeTCX on an older kernel fails with an error
// wrapping ErrTCXUnsupported; ModeAuto falls back to TC). The legacy path
// requires Linux 4.13 (clsact and direct action from 4.5, program IDs in
// filter dumps from 4.13).
func Attach(o Options) (Mode, error) {
	if err := o.check("attach"); err != nil {
		return "", err
	}
	if o.Program == nil {
		return "", fmt.Errorf("attach to interface %d %s: no program", o.Ifindex, o.Hook)
	}
	mode, err := Resolve(o.Mode)
	if err != nil {
		return "", fmt.Errorf("attach to interface %d %s: %w", o.Ifindex, o.Hook, err)
	}
	switch mode {
	case ModeTCX:
		if err := attachTCX(o); err != nil {
			return "", err
		}
		if err := detachTC(o.Ifindex, o.Hook, 0); err != nil {
			return "", err
		}
	case ModeTC:
		if err := attachTC(o); err != nil {
			return "", err
		}
		if o.LinkPin != "" {
			if err := detachTCX(o); err != nil {
				return "", err
			}
		}
	}
	return mode, nil
}

// Detach removes podfence's attachment from the hook, made by either
// mechanism whatever o.Mode says: the TCX link pinned at o.LinkPin (when set)
// is detached and its pin removed, also when the link is already severed;
// podfence's legacy filter is deleted, and the qdisc and other filters are
// left in place. Nothing left to remove (no pin, no veth, no qdisc, no
// filter) is not an error, so Detach can be repeated.
//
// o.Program is optional: when set, a legacy filter running another program is
// not podfence's to remove from this ifindex and is left alone. With
// o.Mode set to ModeTCX, o.LinkPin is required.
//
// o.Ifindex 0 says the interface is gone, and its hooks with it: only the
// TCX link pin, if any, is left to remove (a legacy filter is found by
// ifindex, which another interface may have taken since).
func Detach(o Options) error {
	if o.Ifindex == 0 && o.Hook.valid() {
		if o.LinkPin == "" {
			return nil
		}
		return detachTCX(o)
	}
	if err := o.check("detach"); err != nil {
		return err
	}
	if o.Mode == ModeTCX && o.LinkPin == "" {
		return fmt.Errorf("detach tcx from interface %d %s: no link pin", o.Ifindex, o.Hook)
	}
	var errs []error
	if o.LinkPin != "" {
		errs = append(errs, detachTCX(o))
	}
	var want ebpf.ProgramID
	if o.Program != nil {
		id, err := objinfo.ProgramID(o.Program)
		if err != nil {
			return fmt.Errorf("detach from interface %d %s: %w", o.Ifindex, o.Hook, err)
		}
		want = id
	}
	errs = append(errs, detachTC(o.Ifindex, o.Hook, want))
	return errors.Join(errs...)
}

// Attached lists the IDs of the programs attached to the hook by any
// mechanism: TCX programs (links or not) in their run order, then the BPF
// programs of the clsact filters in the kernel's list order. The list is
// empty, not an error, when nothing is attached; a missing interface is an
// error.
func Attached(ifindex int, h Hook) ([]ebpf.ProgramID, error) {
	o := Options{Ifindex: ifindex, Hook: h}
	if err := o.check("list programs"); err != nil {
		return nil, err
	}
	var ids []ebpf.ProgramID
	err := TCXSupported()
	switch {
	case err == nil:
		tcx, err := attachedTCX(ifindex, h)
		if err != nil {
			return nil, err
		}
		ids = append(ids, tcx...)
	case !errors.Is(err, ErrTCXUnsupported):
		return nil, fmt.Errorf("list programs on interface %d %s: %w", ifindex, h, err)
	}
	tc, err := attachedTC(ifindex, h)
	if err != nil {
		return nil, err
	}
	return append(ids, tc...), nil
}
