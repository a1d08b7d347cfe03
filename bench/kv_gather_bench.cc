// KV store gather throughput: rows of 256 and 512 bytes (head_dim 128 in bf16/f32) at random
// indices, 8 KV heads x 400 selected tokens per layer per sequence, batch 1 and 16, against a
// plain memcpy of the same number of bytes from one contiguous buffer (the ceiling); and the
// host cost of a gather in place, by row address or by block table.
#include <benchmark/benchmark.h>

#include <cstring>
#include <random>
#include <vector>

#include "kv_store/kv_store.h"

namespace infinigen {
namespace {

constexpr int kHeads = 8;
constexpr int64_t kSelected = 400;
constexpr int64_t kStored = 4000;  // tokens per sequence: the gather reads 10%

struct Setup {
  std::unique_ptr<KvStore> store;
  std::vector<std::vector<int32_t>> slots;
  std::vector<std::vector<uint8_t>> k_out, v_out;
  std::vector<GatherItem> items;
  int64_t bytes = 0;

  Setup(int64_t row_bytes, int batch, int threads, bool shared) {
    KvStoreConfig c;
    c.capacity_bytes =
        static_cast<size_t>(batch) * 2 * kHeads * kStored * row_bytes * 11 / 10 + (64 << 20);
    c.block_tokens = 64;
    c.max_row_bytes = row_bytes;
    c.gather_threads = threads;
    c.parallel_gather_bytes = 256 << 10;
    c.shared_memory = shared;
    store = std::move(*KvStore::Create(c));
    SequenceSpec spec;
    spec.num_layers = 1;
    spec.num_kv_heads = kHeads;
    spec.head_dim = static_cast<int>(row_bytes / 2);
    spec.dtype = DType::kBF16;
    std::mt19937 rng(7);
    std::vector<uint8_t> rows(512 * kHeads * row_bytes, 0x5a);
    for (int b = 0; b < batch; ++b) {
      (void)store->Open(b, spec, absl::Now());
      for (int64_t t = 0; t < kStored; t += 512) {
        const int64_t n = std::min<int64_t>(512, kStored - t);
        (void)store->Append(b, 0, t, n, rows.data(), rows.data(), n * kHeads * row_bytes);
      }
      auto& s = slots.emplace_back(kHeads * kSelected);
      for (auto& x : s) x = static_cast<int32_t>(rng() % kStored);
      k_out.emplace_back(kHeads * kSelected * row_bytes);
      v_out.emplace_back(kHeads * kSelected * row_bytes);
    }
    for (int b = 0; b < batch; ++b) {
      items.push_back({static_cast<StoreSequenceId>(b), 0, kSelected, slots[b], k_out[b].data(),
                       v_out[b].data()});
    }
    bytes = 2LL * batch * kHeads * kSelected * row_bytes;
  }
};

void BM_Gather(benchmark::State& state) {
  Setup s(state.range(0), static_cast<int>(state.range(1)), static_cast<int>(state.range(2)),
          state.range(3) != 0);
  for (auto _ : state) {
    auto st = s.store->Gather(s.items);
    if (!st.ok()) state.SkipWithError(std::string(st.message()).c_str());
    benchmark::DoNotOptimize(s.k_out[0].data());
  }
  state.SetBytesProcessed(state.iterations() * s.bytes);
}

// A gather in place, the host's side of what a GPU that reads the mapped arena needs per
// prefetch (256-byte rows): arg 0 = 0 answers each row's K and V addresses (the device then
// gathered by address: Backend::GatherRows), 1 answers the layer's block table instead, every
// block as at a sequence's first gather (Backend::GatherBlockRows; later gathers answer only
// new blocks: see BM_GatherByBlockTableKnown). Items per second = rows per second.
void BM_GatherInPlace(benchmark::State& state) {
  const bool by_table = state.range(0) != 0;
  const int batch = static_cast<int>(state.range(1));
  Setup s(256, batch, 1, true);
  std::vector<std::vector<const void*>> k_rows(batch), v_rows(batch);
  std::vector<std::vector<int32_t>> tables(batch);
  std::vector<int64_t> blocks(batch);
  const int64_t capacity = (kStored + 63) / 64;
  for (int b = 0; b < batch; ++b) {
    GatherItem& it = s.items[b];
    it.k_out = it.v_out = nullptr;
    if (by_table) {
      tables[b].resize(2 * kHeads * capacity);
      it.block_table = {tables[b].data(), capacity, 0, &blocks[b]};
    } else {
      k_rows[b].resize(kHeads * kSelected);
      v_rows[b].resize(kHeads * kSelected);
      it.k_rows = k_rows[b].data();
      it.v_rows = v_rows[b].data();
    }
  }
  for (auto _ : state) {
    auto st = s.store->Gather(s.items);
    if (!st.ok()) state.SkipWithError(std::string(st.message()).c_str());
    benchmark::DoNotOptimize(blocks.data());
  }
  state.SetItemsProcessed(state.iterations() * batch * kHeads * kSelected);
}

// The same, by block table, as a decode step asks: the caller knows every block already.
void BM_GatherByBlockTableKnown(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  Setup s(256, batch, 1, true);
  const int64_t capacity = (kStored + 63) / 64;
  std::vector<std::vector<int32_t>> tables(batch, std::vector<int32_t>(2 * kHeads * capacity));
  std::vector<int64_t> blocks(batch);
  for (int b = 0; b < batch; ++b) {
    s.items[b].k_out = s.items[b].v_out = nullptr;
    s.items[b].block_table = {tables[b].data(), capacity, capacity, &blocks[b]};
  }
  for (auto _ : state) {
    auto st = s.store->Gather(s.items);
    if (!st.ok()) state.SkipWithError(std::string(st.message()).c_str());
    benchmark::DoNotOptimize(blocks.data());
  }
  state.SetItemsProcessed(state.iterations() * batch * kHeads * kSelected);
}

// The same bytes as one contiguous copy: what the gather is compared against. Arg 2 = 0 copies
// the same source every time (cache-warm when it fits); 1 walks a source as large as the
// store's K/V (ten times the bytes), so the bytes come from where the gather's rows live.
void BM_Memcpy(benchmark::State& state) {
  const int64_t bytes = 2LL * state.range(1) * kHeads * kSelected * state.range(0);
  const int64_t copies = state.range(2) != 0 ? kStored / kSelected : 1;
  std::vector<uint8_t> src(bytes * copies, 1), dst(bytes);
  int64_t i = 0;
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data() + (i++ % copies) * bytes, bytes);
    benchmark::DoNotOptimize(dst.data());
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

// Args: row bytes, batch, gather threads, shared memory (memfd) or private (huge pages).
BENCHMARK(BM_Gather)
    ->Args({256, 1, 1, 1})
    ->Args({512, 1, 1, 1})
    ->Args({256, 16, 1, 1})
    ->Args({512, 16, 1, 1})
    ->Args({256, 1, 2, 1})
    ->Args({512, 1, 2, 1})
    ->Args({256, 16, 2, 1})
    ->Args({512, 16, 2, 1})
    ->Args({256, 1, 1, 0})
    ->Args({512, 1, 1, 0})
    ->Args({256, 16, 1, 0})
    ->Args({512, 16, 1, 0})
    ->Args({256, 16, 2, 0})
    ->Args({512, 16, 2, 0})
    ->UseRealTime();
// Args: by block table, batch.
BENCHMARK(BM_GatherInPlace)
    ->Args({0, 1})
    ->Args({1, 1})
    ->Args({0, 16})
    ->Args({1, 16})
    ->UseRealTime();
BENCHMARK(BM_GatherByBlockTableKnown)->Arg(1)->Arg(16)->UseRealTime();
// Args: row bytes, batch, source as large as the store.
BENCHMARK(BM_Memcpy)
    ->Args({256, 1, 0})
    ->Args({512, 1, 0})
    ->Args({256, 16, 0})
    ->Args({512, 16, 0})
    ->Args({256, 1, 1})
    ->Args({512, 1, 1})
    ->Args({256, 16, 1})
    ->Args({512, 16, 1})
    ->UseRealTime();

}  // namespace
}  // namespace infinigen

BENCHMARK_MAIN();
