#include "kv_store/ucx/ucx_wire.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace infinigen {
namespace {

template <typename T>
void Put(std::vector<uint8_t>& out, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

template <typename T>
bool Take(const uint8_t*& p, const uint8_t* end, T* v) {
  if (static_cast<size_t>(end - p) < sizeof(T)) return false;
  std::memcpy(v, p, sizeof(T));
  p += sizeof(T);
  return true;
}

// seq, layer, count, number of indices: the least bytes an item takes.
constexpr size_t kItemHeaderBytes = 8 + 4 + 8 + 8;

}  // namespace

void PutItemCount(std::vector<uint8_t>& out, uint32_t items) { Put<uint32_t>(out, items); }

void PutGatherItem(std::vector<uint8_t>& out, uint64_t seq, int32_t layer, int64_t count,
                   std::span<const int32_t> slots) {
  Put<uint64_t>(out, seq);
  Put<int32_t>(out, layer);
  Put<int64_t>(out, count);
  Put<int64_t>(out, static_cast<int64_t>(slots.size()));
  const auto* p = reinterpret_cast<const uint8_t*>(slots.data());
  out.insert(out.end(), p, p + slots.size_bytes());
}

absl::StatusOr<std::vector<WireGatherItem>> ParseGatherRequest(const uint8_t* data, size_t length) {
  const uint8_t* p = data;
  const uint8_t* end = data + length;
  uint32_t n = 0;
  if (!Take(p, end, &n)) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed gather request: ", length, " bytes hold no item count"));
  }
  if (n > static_cast<size_t>(end - p) / kItemHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed gather request: ", n, " items announced in ", length, " bytes"));
  }
  std::vector<WireGatherItem> items(n);
  for (uint32_t i = 0; i < n; ++i) {
    WireGatherItem& it = items[i];
    int64_t num = 0;
    if (!Take(p, end, &it.seq) || !Take(p, end, &it.layer) || !Take(p, end, &it.count) ||
        !Take(p, end, &num)) {
      return absl::InvalidArgumentError(
          absl::StrCat("malformed gather request: item ", i, " is cut short"));
    }
    if (num < 0 || static_cast<uint64_t>(num) > static_cast<size_t>(end - p) / sizeof(int32_t)) {
      return absl::InvalidArgumentError(absl::StrCat("malformed gather request: item ", i,
                                                     " announces ", num, " indices, ",
                                                     (end - p) / sizeof(int32_t), " follow"));
    }
    it.slots.resize(static_cast<size_t>(num));
    // (memcpy to an empty vector's null data() is undefined even for 0 bytes: UBSan, fuzzing)
    if (num > 0) std::memcpy(it.slots.data(), p, static_cast<size_t>(num) * sizeof(int32_t));
    p += num * sizeof(int32_t);
  }
  if (p != end) {
    return absl::InvalidArgumentError(absl::StrCat("malformed gather request: ", end - p,
                                                   " bytes left over after ", n, " items"));
  }
  return items;
}

}  // namespace infinigen
