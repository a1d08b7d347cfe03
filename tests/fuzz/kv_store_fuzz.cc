// libFuzzer target for the KV store's request validation: the input is a program of Open,
// Append, Gather (copying and in place), Close, Attach, Fork and query calls with arbitrary
// arguments on a small store, as the service and the transports pass them on from the network.
// Buffers are sized exactly as a caller that declared those arguments would size them (heap, so
// ASan sees every byte the store writes or reads outside them); the store must refuse what does not
// fit and never crash. scripts/fuzz.sh builds it with clang and runs it for a bounded time.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "kv_store/kv_store.h"

namespace {

infinigen::KvStore& Store() {
  static auto* store = [] {
    infinigen::KvStoreConfig c;
    c.capacity_bytes = 4 << 20;
    c.block_tokens = 16;
    c.max_row_bytes = 1024;
    c.gather_threads = 1;
    c.shared_memory = false;
    c.huge_pages = false;
    auto s = infinigen::KvStore::Create(c);
    if (!s.ok()) __builtin_trap();
    return s->release();
  }();
  return *store;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  infinigen::KvStore& store = Store();
  const absl::Time now = absl::Now();
  std::vector<uint64_t> opened;
  while (in.remaining_bytes() > 0) {
    const uint64_t seq = in.ConsumeIntegralInRange<uint64_t>(0, 5);
    switch (in.ConsumeIntegralInRange<int>(0, 6)) {
      case 0: {  // Open
        infinigen::SequenceSpec spec;
        spec.num_layers = in.ConsumeIntegralInRange<int>(-1, 6);
        spec.num_kv_heads = in.ConsumeIntegralInRange<int>(-1, 6);
        spec.head_dim = in.ConsumeIntegralInRange<int>(-1, 600);
        spec.dtype = in.ConsumeBool() ? infinigen::DType::kBF16 : infinigen::DType::kF32;
        spec.capacity_tokens = in.ConsumeIntegralInRange<int64_t>(-1, 48);
        spec.owner = "fuzz";
        if (store.Open(seq, spec, now).ok()) opened.push_back(seq);
        break;
      }
      case 1: {  // Append: k and v of `bytes` each, whatever the spec says
        const int layer = in.ConsumeIntegralInRange<int>(-1, 7);
        const int64_t start = in.ConsumeIntegralInRange<int64_t>(-2, 100);
        const int64_t n = in.ConsumeIntegralInRange<int64_t>(-1, 40);
        const size_t bytes = in.ConsumeIntegralInRange<size_t>(0, 1 << 16);
        std::vector<uint8_t> k(bytes, 1), v(bytes, 2);
        const size_t slots = static_cast<size_t>(std::max<int64_t>(n, 0)) * 8;
        std::vector<int32_t> slots_out(slots + 1);
        (void)store.Append(seq, layer, start, n, k.data(), v.data(), bytes,
                           in.ConsumeBool() ? slots_out.data() : nullptr);
        break;
      }
      case 2: {  // Gather of one item, copied or read in place
        const auto spec = store.Spec(seq);
        infinigen::GatherItem item;
        item.seq = seq;
        item.layer = in.ConsumeIntegralInRange<int>(-1, 7);
        item.count = in.ConsumeIntegralInRange<int64_t>(-1, 64);
        item.head_begin = in.ConsumeIntegralInRange<int>(-1, 7);
        item.heads = in.ConsumeIntegralInRange<int>(-1, 7);
        std::vector<int32_t> slots(in.ConsumeIntegralInRange<size_t>(0, 7 * 64));
        for (auto& s : slots) s = in.ConsumeIntegralInRange<int32_t>(-2, 120);
        item.slots = slots;
        // The caller's sizing: the heads it asked for (all of them as it knows the spec) x
        // count x the row size it declares.
        const int64_t heads = item.heads >= 0 ? item.heads : (spec.ok() ? spec->num_kv_heads : 0);
        item.row_bytes = in.ConsumeIntegralInRange<int64_t>(1, 1200);
        const size_t rows =
            static_cast<size_t>(std::max<int64_t>(heads, 0) * std::max<int64_t>(item.count, 0));
        std::vector<uint8_t> k_out(rows * item.row_bytes), v_out(rows * item.row_bytes);
        std::vector<const void*> k_rows(rows), v_rows(rows);
        if (in.ConsumeBool()) {
          item.k_rows = k_rows.data();
          item.v_rows = v_rows.data();
        } else {
          item.k_out = k_out.data();
          item.v_out = v_out.data();
        }
        (void)store.Gather({&item, 1});
        break;
      }
      case 3:
        (void)store.Close(seq);
        break;
      case 4: {
        const int layer = in.ConsumeIntegralInRange<int>(-1, 7);
        (void)store.Length(seq, layer);
        (void)store.Blocks(seq, layer);
        break;
      }
      case 5: {  // Attach or Fork: another id, a spec that may not match, any length
        infinigen::SequenceSpec spec;
        const auto had = store.Spec(seq);
        if (had.ok() && in.ConsumeBool()) spec = *had;
        spec.num_layers =
            in.ConsumeBool() ? spec.num_layers : in.ConsumeIntegralInRange<int>(-1, 6);
        spec.owner = "fuzz-2";
        const uint64_t to = in.ConsumeIntegralInRange<uint64_t>(0, 5);
        const int64_t length = in.ConsumeIntegralInRange<int64_t>(-2, 120);
        const bool fork = in.ConsumeBool();
        if ((fork ? store.Fork(seq, to, spec, length, now).ok()
                  : store.Attach(seq, to, spec, length, now).ok())) {
          opened.push_back(to);
        }
        break;
      }
      default:
        (void)store.Stats();
        break;
    }
  }
  for (uint64_t seq : opened) (void)store.Close(seq);  // every input starts from an empty store
  return 0;
}
