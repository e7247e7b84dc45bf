package main

import (
	"errors"
	"net/netip"
	"reflect"
	"testing"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/policy"
)

func TestOwner(t *testing.T) {
	o := owner{ID: "web-7f65cc6544@default", Container: "4769650347fe1a01c82f5b51"}
	for _, c := range []struct {
		o      owner
		prefix string
		want   bool
	}{
		{o, "web", true},
		{o, "web-7f65cc6544@default", true},
		{o, "4769", true},
		{o, "db", false},
		{o, "7f65", false},   // inside the identifier, not a prefix
		{owner{}, "", false}, // no member on that veth
	} {
		if got := c.o.matches(c.prefix); got != c.want {
			t.Errorf("%+v matches %q: %v, want %v", c.o, c.prefix, got, c.want)
		}
	}
	if got := o.String(); got != "web-7f65cc6544@default/4769650347fe" {
		t.Errorf("String() = %q", got)
	}
	if got := (owner{}).String(); got != "" {
		t.Errorf("no owner prints %q, want nothing", got)
	}
}

func TestIdentStateView(t *testing.T) {
	member := memberState{Member: membership.Member{ContainerID: "c1", IfName: "eth0", HostVeth: "veth1", HostIfindex: 7,
		IPs: []netip.Prefix{netip.MustParsePrefix("10.1.0.5/24"), netip.MustParsePrefix("fd00::5/64")}, AttachMode: "tcx"},
		VethPresent: true, Attached: true}
	for _, c := range []struct {
		name string
		s    identState
		want identifierView
	}{
		{"read", identState{ID: "web@default", Info: bpf.IdentifierInfo{Generation: 3, Mode: policy.ModeStrict,
			Isolated: [2]bool{false, true}, Admin: [2]bool{true, true}, Baseline: [2]bool{true, false}, Layout: "v5 object=ab slot=2", Slot: 2},
			Members: []memberState{member}},
			identifierView{ID: "web@default", Generation: 3, Mode: "strict", Layout: "v5 object=ab slot=2", ServicesJudged: "backend", Isolated: []string{"egress"},
				Tiers: []string{"admin/ingress", "baseline/ingress", "admin/egress"},
				Members: []memberView{{ContainerID: "c1", IfName: "eth0", HostVeth: "veth1", HostIfindex: 7,
					IPs: []string{"10.1.0.5/24", "fd00::5/64"}, AttachMode: "tcx", VethPresent: true, Attached: true}}}},
		{"unreadable pins", identState{ID: "db-0@default", InfoErr: errors.New("incompatible pin"), Unreadable: []string{"k"}},
			identifierView{ID: "db-0@default", Error: "incompatible pin", Isolated: []string{}, Tiers: []string{}, Members: []memberView{},
				Unreadable: []string{"k"}}},
	} {
		if got := c.s.view(); !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s:\n got %+v\nwant %+v", c.name, got, c.want)
		}
	}
}
