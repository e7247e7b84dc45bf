// Package membership is the durable record, in bpffs, of which container
// interfaces use an identifier's pinned programs and maps, and the lock
// under which that record and the pins change.
//
// bpffs holds directories, pins and symlinks only, so a member's record is
// the target of a symlink (see Member.MarshalText). Records outlive every
// process: replicas are added and removed by separate plugin invocations,
// any of which may be killed at any instant.
//
// Invariants, kept by the CNI plugin and the sweeper under Lock:
//
//  1. A member's record is written (atomically) before anything is attached
//     for it, and removed only after its attachments are gone. So every
//     attachment podfence made is reachable from a record, and a member
//     directory without a record (a plugin killed while writing it) holds
//     nothing attached: the container's DEL, or a GC that does not list it,
//     removes it.
//  2. The identifier's pins are removed only by a lock holder that sees no
//     member; every ADD, DEL and GC of an identifier ends by removing the
//     pins when no member is left. Pins without members (a plugin killed
//     between loading and recording) therefore last only until the next
//     call for that identifier (containerd always follows a failed ADD with
//     a DEL) or the next GC.
//  3. Removing the last member deletes the identifier's directory, which is
//     also the lock's; a waiter that wakes up holding a deleted directory
//     retries (Lock), so there are never two holders.
//  4. A record that cannot be decoded (one another version wrote, say) is a
//     member, not an absence: nobody removes pins that a member they cannot
//     read may still use (Scan.InUse). It does not fail the DEL of another
//     member; its own DEL, or a GC that does not list its container, removes
//     it with its directory.
package membership
