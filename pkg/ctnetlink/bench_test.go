package ctnetlink

import (
	"runtime"
	"testing"
	"time"
)

// BenchmarkDump reads a table of 100,000 flows three ways in the same run:
// this package, github.com/ti-mo/conntrack's Dump, and the floor, a reader
// that frames the kernel's messages and decodes nothing. Figures are per
// flow: flows/s and bytes allocated.
func BenchmarkDump(b *testing.B) {
	const flows = 100_000
	n, c := scratch(b)
	createFlows(b, c, flows)
	d := newDumper(b, n)

	var before runtime.MemStats
	report := func(b *testing.B, start time.Time, got int) {
		elapsed := time.Since(start)
		var after runtime.MemStats
		runtime.ReadMemStats(&after)
		if got != flows*b.N {
			b.Fatalf("read %d flows in %d dumps, want %d each", got, b.N, flows)
		}
		b.ReportMetric(float64(got)/elapsed.Seconds(), "flows/s")
		b.ReportMetric(float64(after.TotalAlloc-before.TotalAlloc)/float64(got), "B/flow")
		b.ReportMetric(0, "ns/op")
	}
	perFlow := func(b *testing.B) {
		b.ReportAllocs()
		runtime.ReadMemStats(&before)
	}

	b.Run("ctnetlink", func(b *testing.B) {
		perFlow(b)
		got, start := 0, time.Now()
		for range b.N {
			if err := d.Dump(func(*Flow) error { got++; return nil }); err != nil {
				b.Fatal(err)
			}
		}
		report(b, start, got)
	})
	b.Run("ti-mo-conntrack", func(b *testing.B) {
		perFlow(b)
		got, start := 0, time.Now()
		for range b.N {
			fs, err := c.Dump(nil)
			if err != nil {
				b.Fatal(err)
			}
			got += len(fs)
		}
		report(b, start, got)
	})
	b.Run("floor", func(b *testing.B) {
		perFlow(b)
		got, start := 0, time.Now()
		for range b.N {
			got += rawDump(b, d)
		}
		report(b, start, got)
	})
}

// rawDump counts the flow messages of one dump without decoding them.
func rawDump(b *testing.B, d *Dumper) int {
	d.seq++
	if err := d.c.request(msgCTGet, nlfRequest|nlfDump, d.seq); err != nil {
		b.Fatal(err)
	}
	got := 0
	for {
		buf, err := d.c.read()
		if err != nil {
			b.Fatal(err)
		}
		ms := messages{b: buf}
		for ms.next() {
			if ms.m.typ == nlmsgDone {
				return got
			}
			got++
		}
	}
}
