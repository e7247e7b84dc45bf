package policy

import (
	"errors"
	"fmt"
)

// ErrInvalidDocument is wrapped by every error about the content of a policy
// file (syntax, schema, values), as opposed to failing to read it.
var ErrInvalidDocument = errors.New("invalid policy document")

// ErrTooManyPortRanges is returned by Compile when one prefix needs more port
// ranges than a datapath LPM value holds (MaxPortRanges).
var ErrTooManyPortRanges = errors.New("too many port ranges for one prefix")

// ErrTooManyEntries is returned by Set.Check when one direction and family
// of a policy compiles to more LPM entries than the datapath holds
// (MaxEntries).
var ErrTooManyEntries = errors.New("too many prefixes")

// ErrTooManyPortSets is returned by Set.Check when a policy needs more
// distinct port sets (lists of more than InlinePortRanges ranges) than the
// datapath holds for one identifier (MaxPortSets).
var ErrTooManyPortSets = errors.New("too many distinct port lists")

// invalid builds the error for field (a path such as "spec.ingress[2].cidr",
// empty for the document itself) of the document src ("file#index").
func invalid(src, field, format string, args ...any) error {
	msg := fmt.Sprintf(format, args...)
	if field != "" {
		msg = field + ": " + msg
	}
	return fmt.Errorf("%s: %s: %w", src, msg, ErrInvalidDocument)
}

// ErrTooManyTierRules is returned by TierRules.Compile when one prefix of
// a tier needs more rule slots than a datapath entry holds (MaxTierRules).
var ErrTooManyTierRules = errors.New("too many cluster rules for one prefix")
