#include "gpu_worker/model/stored_tensor.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace infinigen {

int64_t StoredTensor::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string StoredTensor::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

void DecodeToFloat(const StoredTensor& t, float* dst) {
  DecodeBlocks(t.type, t.data, t.NumElements() / StorageBlockElements(t.type), dst);
}

}  // namespace infinigen
