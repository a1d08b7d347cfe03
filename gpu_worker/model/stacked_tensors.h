// Stored tensors laid end to end as one weight matrix for a backend to read: a layer's Q, K and
// V projections stacked along rows, a bias's parts concatenated, or just one tensor.
#pragma once

#include <cstdint>
#include <vector>

#include "gpu_worker/backend/backend.h"
#include "gpu_worker/model/stored_tensor.h"

namespace infinigen {

// `parts` as one [rows, cols] matrix (matrices stacked along rows, or vectors concatenated into
// one row). Every range a backend asks for starts and ends on block boundaries of each part,
// since a part's rows hold whole blocks (the GGUF reader checks it).
class StackedTensors : public StoredWeight {
 public:
  StackedTensors(std::vector<const StoredTensor*> parts, int64_t rows, int64_t cols)
      : parts_(std::move(parts)), rows_(rows), cols_(cols) {}
  int64_t rows() const override { return rows_; }
  int64_t cols() const override { return cols_; }
  void Decode(int64_t r0, int64_t r1, float* out) const override;
  bool ConvertsToQ4_1() const override;
  bool ConvertsToQ4_0() const override;
  void ToQ4_1(int64_t r0, int64_t r1, uint8_t* qs, float* d, float* m) const override;
  bool ConvertsToQ5_1() const override;
  bool ConvertsToQ5_0() const override;
  void ToQ5_1(int64_t r0, int64_t r1, uint8_t* qs, uint32_t* qh, float* d, float* m) const override;
  bool ConvertsToQ6_K() const override;
  void ToQ6_K(int64_t r0, int64_t r1, uint8_t* ql, uint8_t* qh, int8_t* s, float* d) const override;
  std::vector<int64_t> PartEnds() const override;
  std::unique_ptr<StoredWeight> Rows(int64_t r0, int64_t r1) const override;

 private:
  // Calls fn(part, first element in it, element count, offset in the output) for the parts of
  // rows [r0, r1).
  template <typename Fn>
  void ForEachRange(int64_t r0, int64_t r1, Fn fn) const;
  // Whether every part's type passes `converts`.
  bool EveryPart(bool (*converts)(StorageType)) const;

  std::vector<const StoredTensor*> parts_;
  int64_t rows_, cols_;
};

}  // namespace infinigen
