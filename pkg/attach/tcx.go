package attach

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/objinfo"
)

// ErrTCXUnsupported is wrapped when TCX is asked for on a kernel without it.
var ErrTCXUnsupported = errors.New("tcx not supported (requires Linux >= 6.6)")

var (
	tcxOnce sync.Once
	tcxErr  error
)

// TCXSupported reports whether the kernel can attach TCX links: nil when it
// can, ErrTCXUnsupported when it cannot (Linux before 6.6). Any other error
// means the probe itself failed (for example without CAP_BPF) and says why.
// The probe runs once per process and leaves nothing behind.
func TCXSupported() error {
	tcxOnce.Do(func() { tcxErr = probeTCX() })
	return tcxErr
}

// probeTCX asks the kernel to attach a trivial program to an interface
// index that does not exist, expecting a revision no attach point has: a
// kernel with TCX refuses with ENODEV (or ESTALE should the index exist),
// one without it does not know the attach type. Nothing is ever attached.
func probeTCX() error {
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name:         "podfence_probe",
		Type:         ebpf.SchedCLS,
		License:      "Apache-2.0",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()},
	})
	if err != nil {
		return fmt.Errorf("probe tcx: load probe program: %w", err)
	}
	defer prog.Close()
	l, err := link.AttachTCX(link.TCXOptions{
		Interface:        math.MaxInt32,
		Program:          prog,
		Attach:           ebpf.AttachTCXIngress,
		ExpectedRevision: math.MaxUint64,
	})
	switch {
	case err == nil:
		l.Close()
		return nil
	case errors.Is(err, unix.ENODEV), errors.Is(err, unix.ESTALE):
		return nil
	case errors.Is(err, ebpf.ErrNotSupported):
		return ErrTCXUnsupported
	}
	return fmt.Errorf("probe tcx: %w", err)
}

func tcxAttachType(h Hook) ebpf.AttachType {
	if h == HookEgress {
		return ebpf.AttachTCXEgress
	}
	return ebpf.AttachTCXIngress
}

// attachTCX makes the link pinned at o.LinkPin run o.Program on the hook.
// Requires Linux 6.6.
func attachTCX(o Options) error {
	if o.LinkPin == "" {
		return fmt.Errorf("attach tcx to interface %d %s: no link pin", o.Ifindex, o.Hook)
	}
	want, err := objinfo.ProgramID(o.Program)
	if err != nil {
		return fmt.Errorf("attach tcx to interface %d %s: %w", o.Ifindex, o.Hook, err)
	}
	// Each round either finishes or removes a stale pin; a second stale pin
	// or a lost pinning race in a row means something else manages the pin.
	for attempt := 0; attempt < 3; attempt++ {
		l, err := link.LoadPinnedLink(o.LinkPin, nil)
		if errors.Is(err, os.ErrNotExist) {
			err = newTCXLink(o)
			if errors.Is(err, os.ErrExist) {
				continue // another process pinned one meanwhile: update that
			}
			return err
		}
		if err != nil {
			return fmt.Errorf("attach tcx to interface %d %s: open pin %s: %w", o.Ifindex, o.Hook, o.LinkPin, err)
		}
		done, err := updateTCXLink(l, o, want)
		l.Close()
		if err != nil || done {
			return err
		}
	}
	return fmt.Errorf("attach tcx to interface %d %s: pin %s keeps changing", o.Ifindex, o.Hook, o.LinkPin)
}

// updateTCXLink points the pinned link l at o.Program. It returns false when
// the link was severed (its veth is gone) and its pin has been removed, so
// that the caller makes a new one.
func updateTCXLink(l link.Link, o Options, want ebpf.ProgramID) (bool, error) {
	info, err := l.Info()
	if err != nil {
		return false, fmt.Errorf("attach tcx to interface %d %s: pin %s: %w", o.Ifindex, o.Hook, o.LinkPin, err)
	}
	tcx := info.TCX()
	if info.Type != link.TCXType || tcx == nil {
		return false, fmt.Errorf("attach tcx to interface %d %s: pin %s holds a link of type %d, not tcx", o.Ifindex, o.Hook, o.LinkPin, info.Type)
	}
	if tcx.Ifindex == 0 {
		return false, removeSeveredPin(l, o)
	}
	if int(tcx.Ifindex) != o.Ifindex || ebpf.AttachType(tcx.AttachType) != tcxAttachType(o.Hook) {
		// Not severed, so live elsewhere: podfence does not move a live
		// attachment it was not asked about.
		return false, fmt.Errorf("attach tcx to interface %d %s: pin %s holds a link on interface %d (attach type %s)",
			o.Ifindex, o.Hook, o.LinkPin, tcx.Ifindex, ebpf.AttachType(tcx.AttachType))
	}
	if info.Program == want {
		return true, nil
	}
	if err := l.Update(o.Program); err != nil {
		if errors.Is(err, unix.ENOLINK) {
			return false, removeSeveredPin(l, o)
		}
		return false, fmt.Errorf("attach tcx to interface %d %s: replace program of pin %s: %w", o.Ifindex, o.Hook, o.LinkPin, err)
	}
	return true, nil
}

func removeSeveredPin(l link.Link, o Options) error {
	if err := l.Unpin(); err != nil {
		return fmt.Errorf("attach tcx to interface %d %s: remove severed link pin %s: %w", o.Ifindex, o.Hook, o.LinkPin, err)
	}
	return nil
}

// newTCXLink attaches o.Program with a new link and pins it. An error
// wrapping os.ErrExist means another link was pinned there meanwhile; the
// new link is then closed, which detaches it.
func newTCXLink(o Options) error {
	if err := os.MkdirAll(filepath.Dir(o.LinkPin), 0o700); err != nil {
		return fmt.Errorf("attach tcx to interface %d %s: create pin directory: %w", o.Ifindex, o.Hook, err)
	}
	l, err := link.AttachTCX(link.TCXOptions{
		Interface: o.Ifindex,
		Program:   o.Program,
		Attach:    tcxAttachType(o.Hook),
	})
	if err != nil {
		if errors.Is(err, ebpf.ErrNotSupported) {
			err = fmt.Errorf("%w: %w", ErrTCXUnsupported, err)
		}
		return fmt.Errorf("attach tcx to interface %d %s: %w", o.Ifindex, o.Hook, err)
	}
	defer l.Close() // once pinned, closing the fd keeps the link
	if err := l.Pin(o.LinkPin); err != nil {
		return fmt.Errorf("attach tcx to interface %d %s: pin link %s: %w", o.Ifindex, o.Hook, o.LinkPin, err)
	}
	return nil
}

// detachTCX detaches and unpins the link pinned at o.LinkPin, if any,
// whichever interface it is on and also when it is severed. The detach
// takes effect at once, even while another process still holds the link.
func detachTCX(o Options) error {
	l, err := link.LoadPinnedLink(o.LinkPin, nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("detach tcx from interface %d %s: open pin %s: %w", o.Ifindex, o.Hook, o.LinkPin, err)
	}
	defer l.Close()
	var errs []error
	if err := l.Detach(); err != nil && !errors.Is(err, unix.ENOLINK) {
		// Removing the pin below still releases the link once the last
		// file descriptor on it is closed.
		errs = append(errs, fmt.Errorf("detach tcx from interface %d %s: link of pin %s: %w", o.Ifindex, o.Hook, o.LinkPin, err))
	}
	if err := l.Unpin(); err != nil {
		errs = append(errs, fmt.Errorf("detach tcx from interface %d %s: remove pin %s: %w", o.Ifindex, o.Hook, o.LinkPin, err))
	}
	return errors.Join(errs...)
}

// attachedTCX lists the programs on the hook's TCX chain, in run order.
func attachedTCX(ifindex int, h Hook) ([]ebpf.ProgramID, error) {
	res, err := link.QueryPrograms(link.QueryOptions{Target: ifindex, Attach: tcxAttachType(h)})
	if err != nil {
		return nil, fmt.Errorf("list tcx programs on interface %d %s: %w", ifindex, h, err)
	}
	ids := make([]ebpf.ProgramID, 0, len(res.Programs))
	for _, p := range res.Programs {
		ids = append(ids, p.ID)
	}
	return ids, nil
}
