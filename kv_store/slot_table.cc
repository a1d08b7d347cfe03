#include "kv_store/slot_table.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace infinigen {

absl::StatusOr<EvictionPolicy> ParseEvictionPolicy(absl::string_view name) {
  if (name == "counter") return EvictionPolicy::kCounter;
  if (name == "fifo") return EvictionPolicy::kFifo;
  if (name == "lru") return EvictionPolicy::kLru;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown eviction policy '", name, "': expected counter, fifo or lru"));
}

const char* EvictionPolicyName(EvictionPolicy policy) {
  switch (policy) {
    case EvictionPolicy::kCounter:
      return "counter";
    case EvictionPolicy::kFifo:
      return "fifo";
    case EvictionPolicy::kLru:
      return "lru";
  }
  return "?";
}

void SlotTable::Resize(int64_t capacity) {
  position_.resize(capacity, -1);
  fetches_.resize(capacity, 0);
  last_use_.resize(capacity, 0);
  size_ = std::min(size_, capacity);
}

int32_t SlotTable::Place(int64_t position, int64_t step, EvictionPolicy policy, bool* evicted) {
  int32_t slot;
  *evicted = size_ >= capacity();
  if (*evicted) {
    slot = Victim(policy);
  } else {
    slot = static_cast<int32_t>(size_++);
  }
  position_[slot] = position;
  fetches_[slot] = 0;
  last_use_[slot] = step;
  return slot;
}

bool SlotTable::PlaceAt(int32_t slot, int64_t position, int64_t step) {
  const bool evicted = slot < size_;
  if (!evicted) size_ = slot + 1;
  position_[slot] = position;
  fetches_[slot] = 0;
  last_use_[slot] = step;
  return evicted;
}

void SlotTable::Fetched(int32_t slot, int64_t step) {
  if (slot < 0 || slot >= size_) return;
  ++fetches_[slot];
  last_use_[slot] = step;
}

int32_t SlotTable::Victim(EvictionPolicy policy) const {
  auto older = [&](int32_t a, int32_t b) { return position_[a] < position_[b]; };
  // The slot that `before` orders first among `count` slots (all of them, or the first `count`
  // of older_half_), scanned without a copy: this runs for every decode token of a full pool.
  auto first = [&](int64_t count, const int32_t* among, auto before) {
    int32_t best = among != nullptr ? among[0] : 0;
    for (int64_t i = 1; i < count; ++i) {
      const int32_t slot = among != nullptr ? among[i] : static_cast<int32_t>(i);
      if (before(slot, best)) best = slot;
    }
    return best;
  };
  switch (policy) {
    case EvictionPolicy::kFifo:
      return first(size_, nullptr, older);
    case EvictionPolicy::kLru:
      return first(size_, nullptr, [&](int32_t a, int32_t b) {
        return last_use_[a] != last_use_[b] ? last_use_[a] < last_use_[b] : older(a, b);
      });
    case EvictionPolicy::kCounter: {
      const int64_t half = std::max<int64_t>(1, size_ / 2);
      older_half_.resize(static_cast<size_t>(size_));  // capacity kept: no allocation per token
      std::iota(older_half_.begin(), older_half_.end(), 0);
      std::nth_element(older_half_.begin(), older_half_.begin() + (half - 1), older_half_.end(),
                       older);
      return first(half, older_half_.data(), [&](int32_t a, int32_t b) {
        return fetches_[a] != fetches_[b] ? fetches_[a] < fetches_[b] : older(a, b);
      });
    }
  }
  return 0;
}

}  // namespace infinigen
