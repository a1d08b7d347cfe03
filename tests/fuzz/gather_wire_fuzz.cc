// libFuzzer target for the UCX gather request codec (kv_store/ucx/ucx_wire.h): any bytes
// parse to an error or to items that, written again, are exactly the bytes parsed (so nothing
// was read past the end, skipped or invented).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kv_store/ucx/ucx_wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto items = infinigen::ParseGatherRequest(data, size);
  if (!items.ok()) return 0;
  std::vector<uint8_t> again;
  infinigen::PutItemCount(again, static_cast<uint32_t>(items->size()));
  for (const auto& it : *items) {
    infinigen::PutGatherItem(again, it.seq, it.layer, it.count, it.slots);
  }
  if (again.size() != size || !std::equal(again.begin(), again.end(), data)) __builtin_trap();
  return 0;
}
