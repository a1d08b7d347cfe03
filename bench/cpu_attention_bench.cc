// Decode attention on the CPU over every stored row (dense) or over a selection of rows by
// index (what InfiniGen's selection hands the CPU backend), one decode step's worth of layers,
// so that the K/V read (layers x 2 x KV heads x n rows) does not fit in the caches, as in a
// worker. Shapes: SmolLM2-135M (30 layers, 9 query / 3 KV heads of 64) and the Llama-3.1-8B
// attention (8 layers here, 32 query / 8 KV heads of 128). The selection: a fraction of the rows
// per KV head, random and sorted by slot, as InfiniGen's top-k returns them.
//
// usage: cpu_attention_bench [--benchmark_repetitions=3 ...]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <random>
#include <vector>

#include "kernels/cpu/ops.h"

namespace infinigen {
namespace {

struct Shape {
  int layers, heads, kv_heads, dim;
};
constexpr Shape kShapes[] = {{30, 9, 3, 64}, {8, 32, 8, 128}};

// args: shape index, stored rows n, selected per mille (1000 = dense, no indices)
void BM_AttentionDecodeStep(benchmark::State& state) {
  const Shape s = kShapes[state.range(0)];
  const int64_t n = state.range(1);
  const int64_t per_mille = state.range(2);
  const int64_t rows = per_mille >= 1000 ? n : n * per_mille / 1000;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t layer_floats = static_cast<size_t>(s.kv_heads) * n * s.dim;
  std::vector<float> k(layer_floats * s.layers), v(layer_floats * s.layers);
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
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
      cpu::AttentionDecode(q.data(), kr, vr, indices[l].empty() ? nullptr : indices[l].data(), rows,
                           s.heads, s.kv_heads, s.dim, scale, out.data());
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["rows_read"] = static_cast<double>(rows);
  state.counters["kv_bytes_per_step"] = 2.0 * s.layers * s.kv_heads * rows * s.dim * 4;
}
BENCHMARK(BM_AttentionDecodeStep)
    ->ArgsProduct({{0}, {4096, 16384}, {1000, 200}})
    ->ArgsProduct({{1}, {4096, 16384}, {1000, 200}})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace infinigen

BENCHMARK_MAIN();
