package main

import (
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/cilium/ebpf"
)

func main() {
	spec, err := ebpf.LoadCollectionSpec(os.Args[1])
	if err != nil {
		panic(err)
	}
	for name, ps := range spec.Programs {
		maps := map[string]*ebpf.Map{}
		for n, ms := range spec.Maps {
			m, err := ebpf.NewMap(ms)
			if err != nil {
				panic(err)
			}
			maps[n] = m
		}
		_ = ps
		t := time.Now()
		coll, err := ebpf.NewCollectionWithOptions(&ebpf.CollectionSpec{Programs: map[string]*ebpf.ProgramSpec{name: ps}, Maps: spec.Maps, Types: spec.Types}, ebpf.CollectionOptions{MapReplacements: maps, Programs: ebpf.ProgramOptions{LogLevel: ebpf.LogLevelStats}})
		if err != nil {
			panic(err)
		}
		el := time.Since(t)
		p := coll.Programs[name]
		lines := strings.Split(strings.TrimSpace(p.VerifierLog), "\n")
		fmt.Println(name, el, lines[len(lines)-2:])
		coll.Close()
	}
}
