// Decode attention on the CPU over every stored row (dense) or over a selection of rows by
// index (what InfiniGen's selection hands the CPU backend), one decode step's worth of layers,
// so that the K/V read (layers x 2 x KV heads x n rows) does not fit in the caches, as in a
// worker. Shapes: SmolLM2-135M (30 layers, 9 query / 3 KV heads of 64) and the Llama-3.1-8B
// attention (8 layers here, 32 query / 8 KV heads of 128). The selection: a fraction of the rows
// per KV head, random and sorted by slot, as InfiniGen's top-k returns them. The layout: float32
// rows packed per KV head, or the KV store's (bfloat16 rows in 64 KiB blocks placed anywhere in
// one arena, read through a row table: what the served worker's in-process store hands it).
//
// usage: cpu_attention_bench [--benchmark_repetitions=3 ...]
#include <benchmark/benchmark.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/ops.h"

namespace infinigen {
namespace {

struct Shape {
  int layers, heads, kv_heads, dim;
};
constexpr Shape kShapes[] = {{30, 9, 3, 64}, {8, 32, 8, 128}};

// The KV store's layout: an arena of 64 KiB blocks in transparent huge pages (as the store's
// arena), each (layer, K or V, KV head) in its own blocks, placed in a shuffled order, read
// through a row table [kv_heads, n] per layer and K or V.
class StoreArena {
 public:
  explicit StoreArena(size_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) std::abort();
    madvise(p, bytes, MADV_HUGEPAGE);
    data_ = static_cast<uint16_t*>(p);
  }
  ~StoreArena() { munmap(data_, bytes_); }
  StoreArena(const StoreArena&) = delete;
  StoreArena& operator=(const StoreArena&) = delete;
  uint16_t* data() const { return data_; }

 private:
  size_t bytes_;
  uint16_t* data_;
};

// args: shape index, stored rows n, selected per mille (1000 = dense, no indices), layout (0:
// float32 packed, 1: the store's bf16 blocks by row table)
void BM_AttentionDecodeStep(benchmark::State& state) {
  const Shape s = kShapes[state.range(0)];
  const int64_t n = state.range(1);
  const int64_t per_mille = state.range(2);
  const bool store = state.range(3) == 1;
  const int64_t rows = per_mille >= 1000 ? n : n * per_mille / 1000;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t layer_floats = static_cast<size_t>(s.kv_heads) * n * s.dim;
  std::vector<float> k, v;
  // The store's layout: 2 x layers x kv_heads x blocks of block_rows rows.
  const int64_t block_rows = 65536 / (2 * s.dim);
  const int64_t blocks_per_head = (n + block_rows - 1) / block_rows;
  const int64_t blocks = 2LL * s.layers * s.kv_heads * blocks_per_head;
  std::unique_ptr<StoreArena> arena;
  std::vector<std::vector<const void*>> k_tables(s.layers), v_tables(s.layers);
  if (store) {
    const size_t arena_n = static_cast<size_t>(blocks) * block_rows * s.dim;
    arena = std::make_unique<StoreArena>(arena_n * sizeof(uint16_t));
    for (size_t i = 0; i < arena_n; ++i) arena->data()[i] = FloatToBf16(normal(rng));
    std::vector<int64_t> order(blocks);
    for (int64_t b = 0; b < blocks; ++b) order[b] = b;
    std::shuffle(order.begin(), order.end(), rng);
    int64_t next = 0;
    for (int l = 0; l < s.layers; ++l) {
      for (std::vector<const void*>* t : {&k_tables[l], &v_tables[l]}) {
        t->resize(static_cast<size_t>(s.kv_heads) * n);
        for (int g = 0; g < s.kv_heads; ++g) {
          for (int64_t j = 0; j < n; ++j) {
            if (j % block_rows == 0) ++next;
            const int64_t row = order[next - 1] * block_rows + j % block_rows;
            (*t)[g * n + j] = arena->data() + row * s.dim;
          }
        }
      }
    }
  } else {
    k.resize(layer_floats * s.layers);
    v.resize(layer_floats * s.layers);
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
  }
  std::vector<float> q(static_cast<size_t>(s.heads) * s.dim), out(q.size());
  for (float& x : q) x = normal(rng);
  // Per layer and KV head: `rows` distinct slots, sorted.
  std::vector<std::vector<int32_t>> indices(s.layers);
  if (per_mille < 1000) {
    std::vector<int32_t> all(n);
    for (int64_t j = 0; j < n; ++j) all[j] = static_cast<int32_t>(j);
    for (auto& layer : indices) {
      for (int g = 0; g < s.kv_heads; ++g) {
        std::shuffle(all.begin(), all.end(), rng);
        std::vector<int32_t> pick(all.begin(), all.begin() + rows);
        std::sort(pick.begin(), pick.end());
        layer.insert(layer.end(), pick.begin(), pick.end());
      }
    }
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.dim));
  for (auto _ : state) {
    for (int l = 0; l < s.layers; ++l) {
      cpu::KvRows kr{k.data() + l * layer_floats, n * s.dim, s.dim, nullptr};
      cpu::KvRows vr{v.data() + l * layer_floats, n * s.dim, s.dim, nullptr};
      if (store) {
        kr = cpu::KvRows{nullptr, n, 1, k_tables[l].data(), true};
        vr = cpu::KvRows{nullptr, n, 1, v_tables[l].data(), true};
      }
      cpu::AttentionDecode(q.data(), kr, vr, indices[l].empty() ? nullptr : indices[l].data(), rows,
                           s.heads, s.kv_heads, s.dim, scale, out.data());
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["rows_read"] = static_cast<double>(rows);
  state.counters["kv_bytes_per_step"] =
      2.0 * s.layers * s.kv_heads * rows * s.dim * (store ? 2 : 4);
}
BENCHMARK(BM_AttentionDecodeStep)
    ->ArgsProduct({{0}, {4096, 16384}, {1000, 200}, {0, 1}})
    ->ArgsProduct({{1}, {4096, 16384}, {1000, 200}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

// A prefill chunk's attention (the causal rows kernel, as the CPU backend runs it over bf16 K/V):
// `chunk` query rows at positions n - chunk .. n - 1 over the n rows before them, one layer.
// args: shape index, rows n, chunk
void BM_AttentionCausalChunk(benchmark::State& state) {
  const Shape s = kShapes[state.range(0)];
  const int64_t n = state.range(1), chunk = state.range(2);
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> k(static_cast<size_t>(s.kv_heads) * n * s.dim), v(k.size());
  for (uint16_t& x : k) x = FloatToBf16(normal(rng));
  for (uint16_t& x : v) x = FloatToBf16(normal(rng));
  const int64_t q_stride = static_cast<int64_t>(s.heads) * s.dim;
  std::vector<float> q(static_cast<size_t>(chunk) * q_stride), out(q.size());
  for (float& x : q) x = normal(rng);
  const cpu::KvRows kr{k.data(), n * s.dim, s.dim, nullptr, true};
  const cpu::KvRows vr{v.data(), n * s.dim, s.dim, nullptr, true};
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.dim));
  for (auto _ : state) {
    cpu::AttentionCausalRows(q.data(), q_stride, chunk, n - chunk, kr, vr, s.heads, s.kv_heads,
                             s.dim, scale, out.data(), q_stride);
    benchmark::DoNotOptimize(out.data());
  }
}
BENCHMARK(BM_AttentionCausalChunk)
    ->Args({0, 1024, 1024})
    ->Args({0, 8000, 1024})
    ->Args({1, 8000, 1024})
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace infinigen

BENCHMARK_MAIN();
