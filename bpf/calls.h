// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
#pragma once

// KEEP_APART(tag) ends one of several branches that each call a map helper
// on a different map. The compiler would otherwise share one call between
// them and pass the map in a register; the verifier then leaves that call
// generic (an indirect call through the map's ops) instead of calling the
// map's own function, or inlining it as it does for hash and array lookups.
// An empty statement with a different operand per branch cannot be shared.
#define KEEP_APART(tag) asm volatile("" ::"i"(tag))
