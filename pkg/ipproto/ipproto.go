// Package ipproto names IP protocol numbers the one way podfence prints
// them everywhere (dump, sweep, trace, why, ls, logs): the protocols a
// NetworkPolicy names as Kubernetes spells them (TCP, UDP, SCTP), ICMP and
// ICMPv6, and any other number as proto-N.
package ipproto

import "strconv"

// The protocol numbers the datapath treats by name (IANA).
const (
	ICMP   uint8 = 1
	TCP    uint8 = 6
	UDP    uint8 = 17
	ICMPv6 uint8 = 58
	SCTP   uint8 = 132
)

// Name is protocol number p's name.
func Name(p uint8) string {
	switch p {
	case ICMP:
		return "ICMP"
	case TCP:
		return "TCP"
	case UDP:
		return "UDP"
	case ICMPv6:
		return "ICMPv6"
	case SCTP:
		return "SCTP"
	}
	return "proto-" + strconv.Itoa(int(p))
}
