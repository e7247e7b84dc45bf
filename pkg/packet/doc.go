// Package packet builds raw Ethernet frames for tests that run the podfence
// TC programs through BPF_PROG_TEST_RUN, so that no test needs root, a
// namespace or gopacket to produce input.
//
// A Packet describes one IPv4 or IPv6 datagram (the family follows from its
// addresses) with TCP, UDP, SCTP, ICMP, ICMPv6 or any other protocol number,
// including the shapes a parser must survive: IPv4 options (IHL > 5), IPv4
// fragments, chains of IPv6 extension headers (hop-by-hop, routing,
// destination options, fragment, AH and others) and, through Truncate, frames
// cut at any byte. Marshal gets every length field and the IPv4 header
// checksum right and also fills in the TCP, UDP, ICMP, ICMPv6 and SCTP
// checksums, which the programs under test do not verify. Mistakes in a
// Packet (mixed families, options too long, misaligned extension headers)
// panic: they are bugs in the test, not conditions to handle.
package packet
