// CpuBackend's rows kept between steps (KeptRowsPlan, KeptRowsMap): the plain loops those
// structs describe, the reference the CUDA kernels are tested against
// (tests/gpu/cuda_backend_test.cc).
#include <algorithm>

#include "common/status_macros.h"
#include "gpu_worker/backend/cpu_backend.h"

namespace infinigen {
namespace {

// Head g's listed slots: their number (a count above max_count taken as max_count, counted) and
// the j-th of them.
struct HeadList {
  const DeviceSlotList& list;
  int64_t g;
  int64_t Count(int32_t& errors) const {
    int64_t n = list.count != nullptr ? *list.count : list.max_count;
    if (n > list.max_count) {
      if (g == 0) ++errors;
      n = list.max_count;
    }
    return std::max<int64_t>(n, 0);
  }
  int32_t Slot(int64_t j) const {
    return list.slots != nullptr ? list.slots[g * list.capacity + j] : static_cast<int32_t>(j);
  }
  // Whether s is among the first n (ascending: a binary search).
  bool Lists(int32_t s, int64_t n) const {
    if (list.slots == nullptr) return s >= 0 && s < n;
    const int32_t* begin = list.slots + g * list.capacity;
    return std::binary_search(begin, begin + n, s);
  }
};

}  // namespace

absl::Status CpuBackend::PlanKeptRows(const KeptRowsPlan& p) {
  IG_RETURN_IF_ERROR(CheckKeptRowsPlan(p));
  const KeptRows& k = p.kept;
  int32_t errors = 0;
  for (int64_t g = 0; g < k.num_kv_heads; ++g) {
    const HeadList list{p.list, g};
    const int64_t n = list.Count(errors);
    int32_t* row_of = k.row_of + g * k.map_capacity;
    int32_t* slot_of = k.slot_of + g * k.rows;
    // Kept rows whose slots are not listed (every kept row without `keep`) are freed.
    for (int64_t r = 0; r < k.rows; ++r) {
      const int32_t s = slot_of[r];
      if (s < 0 || (p.keep && list.Lists(s, n))) continue;
      if (s < k.map_capacity) row_of[s] = -1;
      slot_of[r] = -1;
    }
    // The free rows, lowest first.
    int32_t* free_rows = p.workspace + g * k.rows;
    int64_t free = 0;
    for (int64_t r = 0; r < k.rows; ++r) {
      if (slot_of[r] < 0) free_rows[free++] = static_cast<int32_t>(r);
    }
    // Each listed slot not held takes the next.
    int64_t moved = 0, missed = 0;
    for (int64_t j = 0; j < n; ++j) {
      const int32_t s = list.Slot(j);
      if (s < 0 || s >= k.map_capacity) {
        ++errors;
        continue;
      }
      if (row_of[s] >= 0) continue;
      if (missed++ >= free) {
        ++errors;
        continue;
      }
      const int32_t r = free_rows[moved];
      row_of[s] = r;
      slot_of[r] = s;
      p.move_slots[g * p.list.capacity + moved] = s;
      p.move_rows[g * p.list.capacity + moved] = r;
      ++moved;
    }
    p.move_counts[g] = static_cast<int32_t>(moved);
    if (p.listed != nullptr) p.listed[g] = static_cast<int32_t>(n);
  }
  if (p.errors != nullptr) *p.errors += errors;
  return absl::OkStatus();
}

absl::Status CpuBackend::MapKeptRows(const KeptRowsMap& m) {
  IG_RETURN_IF_ERROR(CheckKeptRowsMap(m));
  const KeptRows& k = m.kept;
  int32_t errors = 0;
  for (int64_t g = 0; g < k.num_kv_heads; ++g) {
    const HeadList list{m.list, g};
    const int64_t n = list.Count(errors);
    const int32_t* row_of = k.row_of + g * k.map_capacity;
    const int64_t first = g * m.head_rows;  // head g's first row
    const int32_t current = static_cast<int32_t>(m.current_row + g - first);
    int32_t* out = m.out + g * m.list.capacity;
    int64_t misses = 0;
    for (int64_t j = 0; j < n; ++j) {
      const int32_t s = list.Slot(j);
      if (s == m.current_slot) {
        out[j] = current;
      } else if (s >= 0 && s < k.map_capacity && row_of[s] >= 0) {
        out[j] = row_of[s];
      } else if (misses < m.miss_capacity) {
        m.miss_slots[g * m.list.capacity + misses] = s;
        out[j] = static_cast<int32_t>(m.miss_row + g * m.miss_capacity + misses - first);
        ++misses;
      } else {
        ++errors;
        out[j] = current;
      }
    }
    m.miss_counts[g] = static_cast<int32_t>(misses);
  }
  if (m.errors != nullptr) *m.errors += errors;
  return absl::OkStatus();
}

}  // namespace infinigen
