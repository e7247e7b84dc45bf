// Package objinfo reads the few facts about kernel BPF objects that podfence
// checks on every CNI call (IDs, names, the maps a program uses), each with
// a single BPF_OBJ_GET_INFO_BY_FD.
//
// cilium/ebpf's Program.Info and Map.Info return everything about the
// object: a program's translated instructions (13,000 of them here, which the
// kernel rewrites for the copy) and a map's /proc/self/fdinfo (four more
// system calls). Reusing an identifier's pins checks sixteen objects that
// way, and that cost about 0.25 ms of a later replica's ADD, more than the
// rest of the reuse.
//
// The structures below are prefixes of the kernel's struct bpf_prog_info and
// struct bpf_map_info (include/uapi/linux/bpf.h), whose layout is ABI: the
// kernel fills no more than the info_len it is given. Every field used here
// exists from Linux 4.15; podfence requires 5.10.
package objinfo

import (
	"fmt"
	"runtime"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

const (
	cmdMapGetFDByID = 14 // BPF_MAP_GET_FD_BY_ID
	cmdObjGetInfo   = 15 // BPF_OBJ_GET_INFO_BY_FD
)

// progInfo is struct bpf_prog_info up to and including name (Linux 4.15).
type progInfo struct {
	Type            uint32
	ID              uint32
	Tag             [8]byte
	JitedProgLen    uint32
	XlatedProgLen   uint32
	JitedProgInsns  uint64
	XlatedProgInsns uint64
	LoadTime        uint64
	CreatedByUID    uint32
	NrMapIDs        uint32
	MapIDs          unsafe.Pointer // to NrMapIDs uint32s
	Name            [16]byte
}

// mapInfo is struct bpf_map_info up to and including name (Linux 4.15).
type mapInfo struct {
	Type       uint32
	ID         uint32
	KeySize    uint32
	ValueSize  uint32
	MaxEntries uint32
	MapFlags   uint32
	Name       [16]byte
}

// objInfoAttr is the BPF_OBJ_GET_INFO_BY_FD member of union bpf_attr. The
// pointers are unsafe.Pointer, not integers, so that the runtime keeps
// what they point to in place.
type objInfoAttr struct {
	FD      uint32
	InfoLen uint32
	Info    unsafe.Pointer
}

// The kernel's pointer fields are 64 bits wide; so is unsafe.Pointer on the
// 64-bit platforms podfence supports (amd64, arm64), and these fail to
// compile anywhere else.
var (
	_ [unsafe.Sizeof(progInfo{}) - 80]byte
	_ [80 - unsafe.Sizeof(progInfo{})]byte
	_ [unsafe.Sizeof(objInfoAttr{}) - 16]byte
	_ [16 - unsafe.Sizeof(objInfoAttr{})]byte
)

func objInfo(fd int, info unsafe.Pointer, size uintptr) error {
	attr := objInfoAttr{FD: uint32(fd), InfoLen: uint32(size), Info: info}
	_, _, errno := unix.Syscall(unix.SYS_BPF, cmdObjGetInfo, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr))
	if errno != 0 {
		return fmt.Errorf("BPF_OBJ_GET_INFO_BY_FD: %w", errno)
	}
	return nil
}

// Program is what podfence checks about a loaded program.
type Program struct {
	ID   ebpf.ProgramID
	Type ebpf.ProgramType
	Name string // as the kernel truncates it: at most 15 bytes
	// MapIDs are the maps the program uses, its own .rodata included.
	MapIDs []ebpf.MapID
}

// ProgramOf returns the ID, type, name and map IDs of p.
func ProgramOf(p *ebpf.Program) (Program, error) {
	// p owns the descriptor and closes it when collected: keep it until
	// the system calls are done. The same below.
	defer runtime.KeepAlive(p)
	ids := make([]ebpf.MapID, 32)
	for {
		info := progInfo{NrMapIDs: uint32(len(ids)), MapIDs: unsafe.Pointer(&ids[0])}
		if err := objInfo(p.FD(), unsafe.Pointer(&info), unsafe.Sizeof(info)); err != nil {
			return Program{}, fmt.Errorf("program info: %w", err)
		}
		// The kernel reports how many maps the program uses and fills
		// no more IDs than there was room for.
		if n := int(info.NrMapIDs); n > len(ids) {
			ids = make([]ebpf.MapID, n)
			continue
		}
		return Program{
			ID:     ebpf.ProgramID(info.ID),
			Type:   ebpf.ProgramType(info.Type),
			Name:   unix.ByteSliceToString(info.Name[:]),
			MapIDs: ids[:info.NrMapIDs],
		}, nil
	}
}

// ProgramID returns the kernel's ID of p.
func ProgramID(p *ebpf.Program) (ebpf.ProgramID, error) {
	return objectID[ebpf.ProgramID](p, "program")
}

// MapID returns the kernel's ID of m.
func MapID(m *ebpf.Map) (ebpf.MapID, error) {
	return objectID[ebpf.MapID](m, "map")
}

// objectID reads the ID of a program or map: struct bpf_prog_info and
// struct bpf_map_info both begin with the object's type and ID.
func objectID[ID ~uint32](obj interface{ FD() int }, kind string) (ID, error) {
	defer runtime.KeepAlive(obj)
	var info struct{ Type, ID uint32 }
	if err := objInfo(obj.FD(), unsafe.Pointer(&info), unsafe.Sizeof(info)); err != nil {
		return 0, fmt.Errorf("%s info: %w", kind, err)
	}
	return ID(info.ID), nil
}

// MapName returns the name of the map with the given ID, which it opens
// read-only for the call.
func MapName(id ebpf.MapID) (string, error) {
	attr := struct{ ID, NextID, OpenFlags uint32 }{ID: uint32(id), OpenFlags: unix.BPF_F_RDONLY}
	fd, _, errno := unix.Syscall(unix.SYS_BPF, cmdMapGetFDByID, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr))
	if errno != 0 {
		return "", fmt.Errorf("open map %d: BPF_MAP_GET_FD_BY_ID: %w", id, errno)
	}
	defer unix.Close(int(fd))
	var info mapInfo
	if err := objInfo(int(fd), unsafe.Pointer(&info), unsafe.Sizeof(info)); err != nil {
		return "", fmt.Errorf("map %d info: %w", id, err)
	}
	return unix.ByteSliceToString(info.Name[:]), nil
}
