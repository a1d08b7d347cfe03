#include "gpu_worker/backend/backend.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace infinigen {

const char* WeightFormatName(WeightFormat f) {
  switch (f) {
    case WeightFormat::kF32:
      return "f32";
    case WeightFormat::kF16:
      return "f16";
    case WeightFormat::kBF16:
      return "bf16";
    case WeightFormat::kQ8:
      return "q8";
    case WeightFormat::kQ4_1:
      return "q4_1";
    case WeightFormat::kQ5_1:
      return "q5_1";
    case WeightFormat::kQ6_K:
      return "q6_k";
    case WeightFormat::kQ5_0:
      return "q5_0";
    case WeightFormat::kQ4_0:
      return "q4_0";
  }
  return "?";
}

absl::StatusOr<WeightFormat> ParseWeightFormat(absl::string_view name) {
  for (WeightFormat f : {WeightFormat::kF32, WeightFormat::kF16, WeightFormat::kBF16,
                         WeightFormat::kQ8, WeightFormat::kQ4_1}) {
    if (name == WeightFormatName(f)) return f;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown weight format '", name, "': expected f32, f16, bf16, q8 or q4_1"));
}

absl::StatusOr<Weight> Backend::UploadStoredWeight(const StoredWeight& stored) {
  std::vector<float> host(static_cast<size_t>(stored.rows() * stored.cols()));
  stored.Decode(0, stored.rows(), host.data());
  return UploadWeight(host.data(), stored.rows(), stored.cols());
}

absl::StatusOr<Weight> Backend::UploadRandomWeight(int64_t rows, int64_t cols, uint64_t seed,
                                                   float scale) {
  std::vector<float> host(static_cast<size_t>(rows * cols));
  cpu::FillRandom(host.data(), rows * cols, seed, scale);
  return UploadWeight(host.data(), rows, cols);
}

absl::Status Backend::AppendPartialKeys(MatView, const float*, const PartialKeysShape&, void*,
                                        int64_t) {
  return absl::UnimplementedError(absl::StrCat("backend ", Name(), " keeps no partial keys"));
}

absl::Status Backend::ChooseRows(const RowChoiceRequest&, void*) {
  return absl::UnimplementedError(absl::StrCat("backend ", Name(), " does not choose rows"));
}

}  // namespace infinigen
