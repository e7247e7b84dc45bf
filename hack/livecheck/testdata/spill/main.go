// Command spill is the smallest program found that Go 1.26 and 1.27
// compile wrongly: f keeps the address of have[i] across change() in a
// temporary, while have itself is dead there, so the collections in
// change free the maps that f then returns. Run it: "found pointer to
// free object", or rounds whose map lost its entries.
package main

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
)

type entries struct {
	a [2]map[string]int
	b map[string]int
}

//go:noinline
func read(n int) (entries, error) {
	var e entries
	for j := range e.a {
		e.a[j] = map[string]int{}
		for k := range n {
			e.a[j][strconv.Itoa(k)] = k
		}
	}
	e.b = map[string]int{"x": 1}
	return e, nil
}

//go:noinline
func change(h [2]entries) error {
	if len(h[0].a[0]) == 0 {
		return fmt.Errorf("empty")
	}
	runtime.GC()
	runtime.GC()
	junk := make([][]byte, 0, 1000)
	for range 1000 {
		junk = append(junk, make([]byte, 64))
	}
	sink = junk
	return nil
}

var sink any

type result struct{ have entries }

//go:noinline
func f(i int) (*result, error) {
	var have [2]entries
	var err error
	if have[i], err = read(1000); err != nil {
		return nil, err
	}
	have[1-i] = have[i]
	if err := change(have); err != nil {
		return nil, err
	}
	return &result{have: have[i]}, nil
}

func main() {
	lost := 0
	for round := range 200 {
		r, err := f(round & 1)
		if err != nil {
			panic(err)
		}
		runtime.GC()
		for k := range 1000 {
			if v, ok := r.have.a[0][strconv.Itoa(k)]; !ok || v != k {
				lost++
				break
			}
		}
	}
	fmt.Println("rounds whose map lost entries:", lost)
	if lost > 0 {
		os.Exit(1)
	}
}
