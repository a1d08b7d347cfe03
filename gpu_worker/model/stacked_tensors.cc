#include "gpu_worker/model/stacked_tensors.h"

#include <algorithm>
#include <memory>

#include "kernels/cpu/q4_1.h"
#include "kernels/cpu/q5_1.h"
#include "kernels/cpu/q6_k.h"

namespace infinigen {

template <typename Fn>
void StackedTensors::ForEachRange(int64_t r0, int64_t r1, Fn fn) const {
  const int64_t begin = r0 * cols_, end = r1 * cols_;
  int64_t start = 0;
  for (const StoredTensor* t : parts_) {
    const int64_t n = t->NumElements();
    const int64_t lo = std::max(begin, start), hi = std::min(end, start + n);
    if (lo < hi) fn(*t, lo - start, hi - lo, lo - begin);
    start += n;
  }
}

std::vector<int64_t> StackedTensors::PartEnds() const {
  std::vector<int64_t> ends;
  int64_t elements = 0;
  for (const StoredTensor* t : parts_) {
    elements += t->NumElements();
    ends.push_back(cols_ > 0 ? elements / cols_ : 0);
  }
  return ends;
}

std::unique_ptr<StoredWeight> StackedTensors::Rows(int64_t r0, int64_t r1) const {
  std::vector<const StoredTensor*> parts;
  int64_t start = 0;
  bool starts = r0 == 0, ends = false;
  for (const StoredTensor* t : parts_) {
    const int64_t end = start + (cols_ > 0 ? t->NumElements() / cols_ : 0);
    if (start >= r0 && end <= r1) parts.push_back(t);
    starts |= end == r0;
    ends |= end == r1;
    start = end;
  }
  if (!starts || !ends || r0 >= r1) return nullptr;
  return std::make_unique<StackedTensors>(std::move(parts), r1 - r0, cols_);
}

bool StackedTensors::EveryPart(bool (*converts)(StorageType)) const {
  for (const StoredTensor* t : parts_) {
    if (!converts(t->type)) return false;
  }
  return true;
}

void StackedTensors::Decode(int64_t r0, int64_t r1, float* out) const {
  ForEachRange(r0, r1, [&](const StoredTensor& t, int64_t first, int64_t count, int64_t at) {
    const int64_t block = StorageBlockElements(t.type);
    DecodeBlocks(t.type, t.data + first / block * StorageBlockBytes(t.type), count / block,
                 out + at);
  });
}

bool StackedTensors::ConvertsToQ4_1() const { return EveryPart(infinigen::ConvertsToQ4_1); }

bool StackedTensors::ConvertsToQ4_0() const { return EveryPart(infinigen::ConvertsToQ4_0); }

void StackedTensors::ToQ4_1(int64_t r0, int64_t r1, uint8_t* qs, float* d, float* m) const {
  ForEachRange(r0, r1, [&](const StoredTensor& t, int64_t first, int64_t count, int64_t at) {
    const int64_t block = StorageBlockElements(t.type), q4 = at / cpu::kQ4Block;
    ConvertToQ4_1(t.type, t.data + first / block * StorageBlockBytes(t.type), count / block,
                  qs + q4 * (cpu::kQ4Block / 2), d + q4, m == nullptr ? nullptr : m + q4);
  });
}

bool StackedTensors::ConvertsToQ5_1() const { return EveryPart(infinigen::ConvertsToQ5_1); }

bool StackedTensors::ConvertsToQ5_0() const { return EveryPart(infinigen::ConvertsToQ5_0); }

void StackedTensors::ToQ5_1(int64_t r0, int64_t r1, uint8_t* qs, uint32_t* qh, float* d,
                            float* m) const {
  ForEachRange(r0, r1, [&](const StoredTensor& t, int64_t first, int64_t count, int64_t at) {
    const int64_t block = StorageBlockElements(t.type), q5 = at / cpu::kQ5Block;
    ConvertToQ5_1(t.type, t.data + first / block * StorageBlockBytes(t.type), count / block,
                  qs + q5 * (cpu::kQ5Block / 2), qh + q5, d + q5, m == nullptr ? nullptr : m + q5);
  });
}

bool StackedTensors::ConvertsToQ6_K() const { return EveryPart(infinigen::ConvertsToQ6_K); }

void StackedTensors::ToQ6_K(int64_t r0, int64_t r1, uint8_t* ql, uint8_t* qh, int8_t* s,
                            float* d) const {
  ForEachRange(r0, r1, [&](const StoredTensor& t, int64_t first, int64_t count, int64_t at) {
    // Element `at` of the output: ql holds half a byte an element, qh a quarter, s one scale
    // per 16 and d one per super-block.
    const int64_t block = StorageBlockElements(t.type);
    ConvertToQ6_K(t.type, t.data + first / block * StorageBlockBytes(t.type), count / block,
                  ql + at / 2, qh + at / 4, s + at / 16, d + at / cpu::kQ6Super);
  });
}

}  // namespace infinigen
