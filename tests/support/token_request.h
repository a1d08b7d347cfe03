// The part of a Generate request that the router's API (infinigen.v1) and the worker's
// (infinigen.worker.v1) share, filled the same way for tests of either: token ids, sampling and
// a token limit with EOS ignored.
#pragma once

#include <cstdint>
#include <vector>

namespace infinigen::testing {

// Greedy at temperature 0, else top-k 30 with `seed`.
template <typename Request>
void FillTokenRequest(Request& r, const std::vector<int32_t>& prompt, int max_new,
                      float temperature, uint64_t seed) {
  for (int32_t t : prompt) r.mutable_token_ids()->add_ids(t);
  r.mutable_sampling()->set_temperature(temperature);
  r.mutable_sampling()->set_top_k(temperature > 0 ? 30 : 0);
  r.mutable_sampling()->set_seed(seed);
  r.mutable_stopping()->set_max_new_tokens(max_new);
  r.mutable_stopping()->set_ignore_eos(true);
}

}  // namespace infinigen::testing
