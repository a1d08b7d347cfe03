#include "gpu_worker/backend/backend.h"

#include <algorithm>
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
    if (it.count != nullptr) {
      return absl::UnimplementedError(
          absl::StrCat("backend ", Name(), " does not attend over a count in its memory"));
    }
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

namespace {

constexpr int64_t kMaxInt32 = 2147483647;

absl::Status CheckKeptRows(const KeptRows& k, const DeviceSlotList& list, const char* op) {
  auto bad = [op](auto... what) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", what...));
  };
  if (k.num_kv_heads < 1 || k.num_kv_heads > 65535) {
    return bad("num_kv_heads ", k.num_kv_heads, " must be in [1, 65535]");
  }
  if (k.row_of == nullptr || k.slot_of == nullptr) return bad("row_of and slot_of must be set");
  if (k.map_capacity < 1 || k.map_capacity > kMaxInt32 || k.rows < 0 || k.rows > kMaxInt32) {
    return bad("map_capacity ", k.map_capacity, " and rows ", k.rows,
               " must fit in int32 (map_capacity at least 1)");
  }
  if (list.max_count < 0 || list.capacity < list.max_count || list.capacity > kMaxInt32) {
    return bad("the list's capacity ", list.capacity, " must hold max_count (", list.max_count,
               ") and fit in int32");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckKeptRowsPlan(const KeptRowsPlan& p) {
  IG_RETURN_IF_ERROR(CheckKeptRows(p.kept, p.list, "PlanKeptRows"));
  if (p.move_slots == nullptr || p.move_rows == nullptr || p.move_counts == nullptr ||
      (p.kept.rows > 0 && p.workspace == nullptr)) {
    return absl::InvalidArgumentError(
        "PlanKeptRows: move_slots, move_rows, move_counts and workspace must be set");
  }
  return absl::OkStatus();
}

absl::Status CheckKeptRowsMap(const KeptRowsMap& m) {
  IG_RETURN_IF_ERROR(CheckKeptRows(m.kept, m.list, "MapKeptRows"));
  if (m.out == nullptr || m.miss_slots == nullptr || m.miss_counts == nullptr) {
    return absl::InvalidArgumentError("MapKeptRows: out, miss_slots and miss_counts must be set");
  }
  const int64_t heads = m.kept.num_kv_heads;
  // Every row it may write, relative to any head's first row, fits in int32.
  const int64_t spread = heads * std::max<int64_t>(m.head_rows, 0);
  if (m.head_rows < 0 || m.miss_capacity < 0 || m.current_row < 0 || m.miss_row < 0 ||
      m.head_rows > kMaxInt32 || m.current_row + heads + spread > kMaxInt32 ||
      m.miss_row + heads * m.miss_capacity + spread > kMaxInt32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MapKeptRows: head_rows ", m.head_rows, ", current_row ", m.current_row, ", miss_row ",
        m.miss_row, " and miss_capacity ", m.miss_capacity, " must be rows that fit in int32"));
  }
  return absl::OkStatus();
}

absl::Status Backend::PlanKeptRows(const KeptRowsPlan&) {
  return absl::UnimplementedError(absl::StrCat("backend ", Name(), " keeps no rows"));
}

absl::Status Backend::MapKeptRows(const KeptRowsMap&) {
  return absl::UnimplementedError(absl::StrCat("backend ", Name(), " keeps no rows"));
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
