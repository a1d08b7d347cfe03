// Which channels RoPE rotates together, and whether a list of partial channels is whole pairs in
// the order the speculation computes them (kRopePairs). Pure functions: the sidecar's reader and
// the speculation share them.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cpu/ops.h"

namespace infinigen {

// Whether `channels` ([num_kv_heads, p]) of every head are whole RoPE pairs in the order
// kRopePairs computes them: the first members of p/2 pairs, then their partners in the same
// order. rotary_dim must be the whole head.
bool IsRopePairOrder(const std::vector<int32_t>& channels, int num_kv_heads, int partial_dim,
                     int head_dim, int rotary_dim, cpu::RopeLayout layout);
// The partner channel RoPE rotates `c` with (c < rotary_dim).
int RopePartner(int c, int rotary_dim, cpu::RopeLayout layout);

}  // namespace infinigen
