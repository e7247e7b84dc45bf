// Command sides prints, measured on this machine, what the two-sided policy
// (README, "Cluster-wide tiers") costs a change, the grace period it waits
// before rewriting the side it left (membarrier, as bpf.WaitForPrograms),
// and what the alternative to naming both sides' maps directly would cost
// a packet: a trie lookup through an ARRAY_OF_MAPS slot against a direct
// one, in the same run. Root; hack/sides.sh compiles the programs first.
package main

import (
	"encoding/binary"
	"flag"
	"fmt"
	"log"
	"slices"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// key is struct key in bpf/sides.c.
type key struct {
	Prefixlen uint32
	Addr      [4]byte
}

// lookups is LOOKUPS in bpf/sides.c: one program run makes that many.
const lookups = 64

func main() {
	obj := flag.String("obj", "", "the compiled bpf/sides.c")
	rounds := flag.Int("rounds", 5, "rounds of both programs, each the median of 15 runs")
	flag.Parse()
	spec, err := ebpf.LoadCollectionSpec(*obj)
	if err != nil {
		log.Fatal(err)
	}
	coll, err := ebpf.NewCollection(spec)
	if err != nil {
		log.Fatal(err)
	}
	defer coll.Close()
	if err := fill(coll.Maps["direct"]); err != nil {
		log.Fatal(err)
	}
	for side := uint32(0); side < 2; side++ {
		inner, err := ebpf.NewMap(spec.Maps["sides"].InnerMap)
		if err != nil {
			log.Fatal(err)
		}
		if err := fill(inner); err != nil {
			log.Fatal(err)
		}
		if err := coll.Maps["sides"].Put(side, inner); err != nil {
			log.Fatal(err)
		}
		inner.Close() // the outer map holds it
	}
	pkt := make([]byte, 64)
	for _, name := range []string{"via_direct", "via_sides"} {
		// Each program returns how many of its lookups hit: a lookup
		// that misses at the trie's root would measure nothing.
		hits, _, err := coll.Programs[name].Benchmark(pkt, 1, nil)
		if err != nil {
			log.Fatal(err)
		}
		if hits != lookups {
			log.Fatalf("%s: %d of %d lookups hit, want all", name, hits, lookups)
		}
	}
	median := func(name string) time.Duration {
		var ds []time.Duration
		for range 15 {
			_, d, err := coll.Programs[name].Benchmark(pkt, 20000, nil)
			if err != nil {
				log.Fatal(err)
			}
			ds = append(ds, d)
		}
		slices.Sort(ds)
		return ds[len(ds)/2]
	}
	fmt.Printf("trie lookups (2,048 prefixes, all hit), %d per run\n", lookups)
	for range *rounds {
		d, s := median("via_direct"), median("via_sides")
		fmt.Printf("  direct %5.1f ns per lookup, through the side's slot %5.1f ns: %+5.2f ns (%.3fx)\n",
			float64(d)/lookups, float64(s)/lookups, float64(s-d)/lookups, float64(s)/float64(d))
	}
	var gp []time.Duration
	for range 100 {
		t := time.Now()
		if _, _, errno := unix.Syscall(unix.SYS_MEMBARRIER, 1 /* MEMBARRIER_CMD_GLOBAL */, 0, 0); errno != 0 {
			log.Fatalf("membarrier: %v", errno)
		}
		gp = append(gp, time.Since(t))
	}
	slices.Sort(gp)
	fmt.Printf("grace period (membarrier MEMBARRIER_CMD_GLOBAL, 100 calls): p50 %v, p99 %v\n", gp[50], gp[98])
}

// fill puts 2,048 prefixes (/16s and /24s in 10.0.0.0/8) in m, so that a
// lookup walks a trie of a realistic depth; addrOf in bpf/sides.c makes
// addresses inside the /24s.
func fill(m *ebpf.Map) error {
	for i := uint32(0); i < 1024; i++ {
		var k key
		k.Prefixlen = 24
		binary.BigEndian.PutUint32(k.Addr[:], 0x0a000000|(i*2654435761>>8)&0xffff00)
		if err := m.Put(k, i); err != nil {
			return err
		}
		k.Prefixlen = 16
		binary.BigEndian.PutUint32(k.Addr[:], 0x0a000000|(i<<16)&0xff0000)
		if err := m.Put(k, i); err != nil {
			return err
		}
	}
	return nil
}
