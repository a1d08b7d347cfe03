// Slot lists as consecutive decode steps choose them, for tests of the rows kept between steps
// (ReusedRows, Backend::PlanKeptRows).
#pragma once

#include <cstdint>
#include <random>
#include <set>
#include <vector>

namespace infinigen::testing {

// A head's ascending list of `count` slots below `stored`, sharing about `keep` of `last`.
inline std::vector<int32_t> NextList(const std::vector<int32_t>& last, int64_t count,
                                     int64_t stored, double keep, std::mt19937& rng) {
  std::set<int32_t> chosen;
  std::bernoulli_distribution stays(keep);
  for (int32_t s : last) {
    if (static_cast<int64_t>(chosen.size()) < count && s < stored && stays(rng)) chosen.insert(s);
  }
  std::uniform_int_distribution<int32_t> any(0, static_cast<int32_t>(stored - 1));
  while (static_cast<int64_t>(chosen.size()) < count) chosen.insert(any(rng));
  return {chosen.begin(), chosen.end()};
}

}  // namespace infinigen::testing
