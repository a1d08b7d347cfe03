#include "gpu_worker/model/rope_pairs.h"

#include <cstddef>

namespace infinigen {

int RopePartner(int c, int rotary_dim, cpu::RopeLayout layout) {
  if (layout == cpu::RopeLayout::kInterleaved) return c ^ 1;
  const int half = rotary_dim / 2;
  return c < half ? c + half : c - half;
}

bool IsRopePairOrder(const std::vector<int32_t>& channels, int num_kv_heads, int partial_dim,
                     int head_dim, int rotary_dim, cpu::RopeLayout layout) {
  if (rotary_dim != head_dim || partial_dim % 2 != 0 || partial_dim == 0 ||
      channels.size() != static_cast<size_t>(num_kv_heads) * partial_dim) {
    return false;
  }
  const int m = partial_dim / 2;
  for (int g = 0; g < num_kv_heads; ++g) {
    const int32_t* ch = channels.data() + static_cast<size_t>(g) * partial_dim;
    for (int i = 0; i < m; ++i) {
      // The first member of each pair is its lower channel, as the compact RoPE rotates it.
      if (ch[i] < 0 || ch[i] >= head_dim || ch[m + i] != RopePartner(ch[i], rotary_dim, layout) ||
          ch[m + i] < ch[i]) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace infinigen
