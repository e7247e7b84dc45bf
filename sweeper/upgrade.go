package main

import (
	"fmt"
	"io"
	"log/slog"
	"text/tabwriter"
	"time"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/pinroot"
)

// upgradeReport is what `upgrade --json` prints: the node's layout, what
// became of the global maps, and one line per identifier with members.
type upgradeReport struct {
	Layout      uint32             `json:"layout"`
	GlobalFrom  uint32             `json:"globalFrom"`
	GlobalMaps  []string           `json:"globalMaps"`
	Identifiers []upgradedIdentity `json:"identifiers"`
	Errors      []string           `json:"errors,omitempty"`
}

type upgradedIdentity struct {
	ID       string   `json:"identifier"`
	From     uint32   `json:"from"`
	Maps     []string `json:"maps"`
	Programs bool     `json:"programs"`
	Moved    int      `json:"moved"`
	Changed  bool     `json:"changed"`
	Unmoved  string   `json:"unmoved,omitempty"` // why members did not move
}

// cmdUpgrade takes the node's pins over for this build, once: what run
// does when it starts, for a node whose sweeper is not running.
func cmdUpgrade(args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlags("upgrade", stderr, &c, false)
	if err := parse(fs, args); err != nil {
		return err
	}
	root, err := openRoot(&c, upgrade)
	if err != nil {
		return err
	}
	defer root.Close()
	rep, err := upgradeNode(root)
	if c.json {
		if werr := writeJSON(stdout, rep); werr != nil {
			return werr
		}
		return err
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "layout %d; global maps from layout %d, replaced: %s\n", rep.Layout, rep.GlobalFrom, listOrDash(rep.GlobalMaps))
	fmt.Fprintln(tw, "IDENTIFIER\tFROM\tMAPS REPLACED\tPROGRAMS\tMOVED")
	for _, u := range rep.Identifiers {
		progs := "kept"
		if u.Programs {
			progs = "replaced"
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%d\n", u.ID, u.From, listOrDash(u.Maps), progs, u.Moved)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	return err
}

// upgradeNode runs pinroot.Root.Upgrade on the node, whose global maps
// this build opened (and so renewed).
func upgradeNode(root *pinroot.Root) (upgradeReport, error) {
	g, err := root.Global()
	if err != nil {
		return upgradeReport{}, err
	}
	rep := upgradeReport{Layout: bpf.LayoutVersion, GlobalFrom: g.Renewal.From, GlobalMaps: nonNil(g.Renewal.Maps), Identifiers: []upgradedIdentity{}}
	ups, err := root.Upgrade()
	for _, u := range ups {
		rep.Identifiers = append(rep.Identifiers, upgradedIdentity{
			ID: string(u.ID), From: u.Renewal.From, Maps: nonNil(u.Renewal.Maps), Programs: u.Renewal.Programs, Moved: u.Moved, Changed: u.Changed(),
		})
		if u.Unmoved != nil {
			rep.Identifiers[len(rep.Identifiers)-1].Unmoved = u.Unmoved.Error()
		}
	}
	if err != nil {
		rep.Errors = []string{err.Error()}
	}
	return rep, err
}

// logUpgrade says what run's upgrade at start changed, one line per
// identifier it changed and one in all.
func logUpgrade(log *slog.Logger, rep upgradeReport, took time.Duration, err error) {
	changed := 0
	for _, u := range rep.Identifiers {
		if !u.Changed {
			continue
		}
		changed++
		log.Info("identifier upgraded", "id", u.ID, "from_layout", u.From, "maps_replaced", u.Maps, "programs_replaced", u.Programs, "members_moved", u.Moved)
	}
	if err != nil {
		log.Error("upgrade: some identifiers keep their earlier pins", "error", err)
	}
	if changed > 0 || len(rep.GlobalMaps) > 0 || err != nil {
		log.Info("upgrade", "layout", rep.Layout, "global_from_layout", rep.GlobalFrom, "global_maps_replaced", rep.GlobalMaps,
			"identifiers", len(rep.Identifiers), "identifiers_changed", changed, "duration_ms", took.Milliseconds())
	}
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

func listOrDash(s []string) string {
	if len(s) == 0 {
		return "-"
	}
	return fmt.Sprint(s)
}
