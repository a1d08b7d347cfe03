#include "gpu_worker/backend/backend.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

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

absl::Status Backend::AttentionDecodeBatch(std::span<const DecodeAttentionItem> items,
                                           const AttentionShape& shape) {
  for (const DecodeAttentionItem& it : items) {
    IG_RETURN_IF_ERROR(AttentionDecode(it.q, it.k, it.v, it.indices, it.num_rows, shape, it.out));
  }
  return absl::OkStatus();
}

absl::Status CheckBlockRowsGather(const BlockRowsGather& g) {
  auto bad = [](auto... what) {
    return absl::InvalidArgumentError(absl::StrCat("GatherBlockRows: ", what...));
  };
  if (g.batch < 0 || g.max_count < 0) return bad("batch and max_count must not be negative");
  if (g.batch == 0 || g.max_count == 0) return absl::OkStatus();  // nothing to gather
  if (g.num_kv_heads < 1) return bad("num_kv_heads ", g.num_kv_heads, " must be at least 1");
  if (g.row_bytes < 1 || g.rows_per_block < 1) {
    return bad("row_bytes ", g.row_bytes, " and rows_per_block ", g.rows_per_block,
               " must be at least 1");
  }
  // Divided, not multiplied: nothing here may overflow whatever the sizes.
  if (static_cast<uint64_t>(g.rows_per_block) >
      g.block_bytes / static_cast<uint64_t>(g.row_bytes)) {
    return bad("block_bytes ", g.block_bytes, " is less than rows_per_block (", g.rows_per_block,
               ") x row_bytes (", g.row_bytes, ")");
  }
  if (g.block_bytes > g.arena_bytes) {
    return bad("block_bytes ", g.block_bytes, " is more than the arena's ", g.arena_bytes);
  }
  if (g.arena == nullptr || g.tables == nullptr || g.slots == nullptr || g.dst == nullptr) {
    return bad("arena, tables, slots and dst must be set");
  }
  // Rows of 16-bit or wider elements (what a device's copy is made of), lists within a launch.
  const auto odd = [](auto v) { return (static_cast<uint64_t>(v) & 1) != 0; };
  if (odd(g.row_bytes) || odd(g.block_bytes) || odd(reinterpret_cast<uintptr_t>(g.arena)) ||
      odd(reinterpret_cast<uintptr_t>(g.dst))) {
    return bad("row_bytes, block_bytes and the arena and dst addresses must be even");
  }
  if (g.batch > 65535 || g.num_kv_heads > 65535) {
    return bad("batch ", g.batch, " and num_kv_heads ", g.num_kv_heads, " must be at most 65535");
  }
  if (g.table_capacity < 1) return bad("table_capacity must be at least 1");
  if (g.slot_capacity < g.max_count || g.dst_rows_per_list < g.max_count) {
    return bad("slot_capacity ", g.slot_capacity, " and dst_rows_per_list ", g.dst_rows_per_list,
               " must hold max_count (", g.max_count, ") rows");
  }
  return absl::OkStatus();
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
