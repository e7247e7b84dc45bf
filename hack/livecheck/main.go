// Command livecheck looks through the compiler's assembly and liveness
// output for a pattern that Go 1.26 and 1.27 compile wrongly: the address
// of an element of a local array, taken with a variable index
// (have[inForce]), kept in a compiler temporary and used across calls,
// while the array itself is no longer live. The collector then scans
// neither, and frees what only the array refers to while the temporary
// still reaches it. bpf's switchPolicy lost the maps it had read that way
// (TestApplyPolicyKeepsWhatItReadAcrossCollections); a few runs in a
// hundred saw it, as a corrupted map, an impossible trie key or a hang.
//
// It runs `go build -gcflags='-S -live'` on the packages named (./... by
// default; the build cache replays the output) and lists each call at
// which such a temporary is live without its array, exiting 1 if there is
// one. Reach the array through a pointer (p := new([2]T); p[i]) instead:
// the pointer keeps it live. The check errs on the side of silence (it
// follows the one instruction sequence the compiler uses for such a
// temporary on amd64), so an empty list is no proof, but a line in it is
// worth reading.
package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
)

var (
	funcStart = regexp.MustCompile(`^(\S+) STEXT`)
	// 0x0197 00407 (/src/bpf/policy.go:110)	LEAQ	pkg.have+304(SP)(CX*1), DX
	instr = regexp.MustCompile(`^\s+0x[0-9a-f]+ \d+ \((.+):(\d+)\)\s+(\w+)\s*(.*)$`)
	// The address of an element of a local array, at a variable index.
	indexedAddr = regexp.MustCompile(`\.([A-Za-z_]\w*)\+\d+\(SP\)\(\w+\*\d\), (\w+)$`)
	// A register stored into a compiler temporary.
	toTemp = regexp.MustCompile(`^(\w+), \S*?\.\.(autotmp_\d+)\+\d+\(SP\)$`)
	// bpf/policy.go:159:24: live at call to f: &st .autotmp_187 i
	liveAt = regexp.MustCompile(`^(\S+?):(\d+):\d+: live at (entry to|call to) ([^:]+):? ?(.*)$`)
)

// temp is a compiler temporary holding the address of an array element.
type temp struct {
	fn, name, array, file string
	line                  int
}

// liveSet is what -live reports at one call, or at a function's entry.
type liveSet struct {
	file, callee string
	line         int
	entry        bool
	names        map[string]bool
}

func main() {
	pkgs := os.Args[1:]
	if len(pkgs) == 0 {
		pkgs = []string{"./..."}
	}
	found, err := check(pkgs)
	if err != nil {
		fmt.Fprintf(os.Stderr, "livecheck: %v\n", err)
		os.Exit(2)
	}
	for _, f := range found {
		fmt.Println(f)
	}
	if len(found) > 0 {
		fmt.Println("livecheck: reach these arrays through a pointer (see hack/livecheck/main.go)")
		os.Exit(1)
	}
}

// check builds pkgs and returns a line for each call at which a temporary
// holding the address of an array element is live and the array is not.
func check(pkgs []string) ([]string, error) {
	cmd := exec.Command("go", append([]string{"build", "-o", os.DevNull, "-gcflags=-S -live"}, pkgs...)...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("go build: %w\n%s", err, out.Bytes())
	}
	temps, lives := parse(&out)
	var found []string
	for _, t := range temps {
		for _, l := range unprotected(t, lives) {
			found = append(found, fmt.Sprintf("%s: %s:%d: .%s = &%s[i] is live at the call to %s (line %d), %s is not",
				t.fn, t.file, t.line, t.name, t.array, l.callee, l.line, t.array))
		}
	}
	return found, nil
}

func parse(out *bytes.Buffer) ([]temp, []liveSet) {
	var (
		temps []temp
		lives []liveSet
		fn    string
		regs  = map[string]string{} // register -> array whose element it addresses
	)
	sc := bufio.NewScanner(out)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if m := funcStart.FindStringSubmatch(line); m != nil {
			fn, regs = m[1], map[string]string{}
			continue
		}
		if m := liveAt.FindStringSubmatch(line); m != nil {
			n, _ := strconv.Atoi(m[2])
			names := map[string]bool{}
			for _, s := range strings.Fields(m[5]) {
				names[s] = true
			}
			lives = append(lives, liveSet{file: m[1], line: n, entry: m[3] == "entry to", callee: m[4], names: names})
			continue
		}
		m := instr.FindStringSubmatch(line)
		if m == nil || fn == "" {
			continue
		}
		file, op, args := m[1], m[3], m[4]
		n, _ := strconv.Atoi(m[2])
		if op == "LEAQ" {
			if a := indexedAddr.FindStringSubmatch(args); a != nil && !strings.HasPrefix(a[1], "autotmp") {
				regs[a[2]] = a[1]
				continue
			}
		}
		if op == "CALL" {
			regs = map[string]string{}
			continue
		}
		if op == "MOVQ" {
			if t := toTemp.FindStringSubmatch(args); t != nil {
				if array, ok := regs[t[1]]; ok {
					temps = append(temps, temp{fn: fn, name: t[2], array: array, file: file, line: n})
				}
				continue
			}
		}
		// Any other write to a register ends what it addressed.
		if i := strings.LastIndex(args, ", "); i >= 0 {
			delete(regs, args[i+2:])
		}
	}
	return temps, lives
}

// unprotected returns the calls, within t's function, at which t is live
// and its array is not. -live names files relative to the module, the
// assembly absolutely; a function ends at the next one's entry in its file.
func unprotected(t temp, lives []liveSet) []liveSet {
	var out []liveSet
	same := func(l liveSet) bool { return strings.HasSuffix(t.file, "/"+l.file) || t.file == l.file }
	end := -1
	for _, l := range lives {
		if l.entry && same(l) && l.line > t.line && (end < 0 || l.line < end) {
			end = l.line
		}
	}
	for _, l := range lives {
		if l.entry || !same(l) || l.line < t.line || (end >= 0 && l.line >= end) {
			continue
		}
		if l.names["."+t.name] && !l.names[t.array] && !l.names["&"+t.array] {
			out = append(out, l)
		}
	}
	return out
}
