package bpf

import (
	"fmt"
	"testing"

	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/test/kernel"
)

// BenchmarkOpenIdentifier measures what a CNI ADD pays in the loader: a first
// replica loads and verifies both programs and creates its maps; a later one
// reuses the pins.
func BenchmarkOpenIdentifier(b *testing.B) {
	root := kernel.PinRoot(b)
	g, err := OpenGlobal(globalDir(root), GlobalOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer g.Close()
	b.Run("first", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			id := podid.ID(fmt.Sprintf("web-%d@default", i))
			ident, err := OpenIdentifier(g, identDir(root, id), id)
			if err != nil {
				b.Fatal(err)
			}
			ident.Close()
			b.StopTimer()
			if err := RemoveIdentifier(identDir(root, id)); err != nil {
				b.Fatal(err)
			}
			b.StartTimer()
		}
	})
	b.Run("reuse", func(b *testing.B) {
		ident, err := OpenIdentifier(g, identDir(root, "web@default"), "web@default")
		if err != nil {
			b.Fatal(err)
		}
		ident.Close()
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			ident, err := OpenIdentifier(g, identDir(root, "web@default"), "web@default")
			if err != nil {
				b.Fatal(err)
			}
			ident.Close()
		}
	})
}
