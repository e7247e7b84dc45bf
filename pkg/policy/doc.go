// Package policy reads PolicyEndpoint documents (networking.k8s.aws/v1alpha1,
// the schema the AWS network-policy controller writes), selects those that
// apply to a pod identifier, and compiles one direction's rules into the
// longest-prefix-match entries the eBPF datapath looks up. It also reads the
// controller's cluster-wide ClusterPolicyEndpoint documents, whose tiers
// (Admin before NetworkPolicy, Baseline after) Decide evaluates and
// TierRules.Compile flattens into prioritized entries.
//
// It is pure Go with no kernel access. What it guarantees:
//
//   - Parsing is strict below spec: an unknown key, a key in the wrong case,
//     a duplicate key, a value of the wrong type or out of range is an error
//     wrapping ErrInvalidDocument that names the file, the document index and
//     the field path, so a typo can never silently widen or narrow a policy.
//     Top-level and metadata keys other than those used are ignored.
//   - DirectionPolicy.Allows is the plain NetworkPolicy evaluation; it is the
//     reference the datapath is tested against.
//   - DirectionPolicy.Compile produces entries for which a longest-prefix
//     lookup followed by a scan of the entry's port ranges gives exactly
//     Allows (a randomized test checks this).
package policy
