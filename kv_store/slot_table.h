// Which token sits in each slot of one (sequence, layer, KV head) of a capacity-limited KV
// pool, with the per-token statistics that eviction reads (INFINIGEN.md, "KV pool with a memory
// limit"). Shared by the KV store and the worker's resident KvPoolCache.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace infinigen {

enum class EvictionPolicy {
  kCounter,  // the lowest fetch count among the older half of the slots (the paper's policy)
  kFifo,     // the oldest token
  kLru,      // the least recently fetched token
};
absl::StatusOr<EvictionPolicy> ParseEvictionPolicy(absl::string_view name);
const char* EvictionPolicyName(EvictionPolicy policy);

class SlotTable {
 public:
  void Resize(int64_t capacity);
  int64_t capacity() const { return static_cast<int64_t>(position_.size()); }
  int64_t size() const { return size_; }

  // The slot for a new token: the next free one, else the victim `policy` picks.
  int32_t Place(int64_t position, int64_t step, EvictionPolicy policy, bool* evicted);
  // Puts the token at `position` in `slot` (a choice made elsewhere, e.g. by the worker that
  // mirrors this table): `slot` < capacity() and at most size() (no holes). True when it
  // overwrote a token.
  bool PlaceAt(int32_t slot, int64_t position, int64_t step);
  void Fetched(int32_t slot, int64_t step);
  int64_t Position(int32_t slot) const { return position_[slot]; }
  const std::vector<int64_t>& positions() const { return position_; }

 private:
  int32_t Victim(EvictionPolicy policy) const;

  int64_t size_ = 0;
  std::vector<int64_t> position_;            // [slot] token position, -1 when free
  std::vector<int64_t> fetches_;             // [slot] fetches since the token arrived
  std::vector<int64_t> last_use_;            // [slot] step of the last fetch or the arrival
  mutable std::vector<int32_t> older_half_;  // Victim's scratch (kCounter)
};

}  // namespace infinigen
