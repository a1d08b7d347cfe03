// The host side of InfiniGen per decode layer and sequence: what a worker's host computes for
// every sparse layer of every decode token, at the Llama-3.1-8B attention shape (32 query heads,
// 8 KV heads of 128 dims, partial ratio 0.2: d' = 26) over n stored tokens. One iteration = the
// prefetch's Preselect over the n stored rows (speculated scores, budget, group attention mass,
// top-k plus a margin), the new token's partial key (OnKeys), and the layer's Select over n + 1
// rows (reusing the preselect's scores). Budget 20%, alpha 10, random keys and queries.
// BM_SelectInPlace: what the CPU engine runs per sparse layer when it reads the K/V in place
// (resident, or an in-process store): the layer's Select alone over n + 1 rows (no prefetch, so
// nothing to reuse), at SmolLM2-135M's shape (9 query heads, 3 KV heads of 64, d' = 26);
// BM_SelectInPlaceEveryLayer the same over 29 layers in turn (partial keys read from memory).
//
// usage: selection_bench [--benchmark_repetitions=3 ...]
#include <benchmark/benchmark.h>

#include <memory>
#include <random>
#include <vector>

#include "gpu_worker/infinigen/selection_config.h"
#include "gpu_worker/infinigen/sidecar.h"

namespace infinigen {
namespace {

struct Shape {
  int heads, kv_heads, dim;
};
constexpr Shape kLlama8B{32, 8, 128};
constexpr Shape kSmolLm2{9, 3, 64};

struct Setup {
  ModelConfig model;
  InfinigenSidecar sidecar;
  std::unique_ptr<KvSelectionPolicy> policy;
  std::vector<float> q;  // [heads, d]: the speculated and the actual query
  std::vector<float> key;
  std::vector<int32_t> slots;

  // `layers` layers, the first dense (as the benchmarks' configuration has it since the start:
  // one); every other one holds the prompt's n keys.
  Setup(int64_t n, Shape shape, int layers = 2) {
    const int kHeads = shape.heads, kKvHeads = shape.kv_heads, kDim = shape.dim;
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    model.num_layers = layers;
    model.num_heads = kHeads;
    model.num_kv_heads = kKvHeads;
    model.head_dim = kDim;
    sidecar.num_layers = layers;
    sidecar.num_kv_heads = kKvHeads;
    sidecar.head_dim = kDim;
    sidecar.partial_dim = 26;
    for (int l = 0; l < layers; ++l) {
      std::vector<float> skew(static_cast<size_t>(kKvHeads) * kDim * kDim);
      for (float& x : skew) x = normal(rng) * 0.09f;
      sidecar.skew.push_back(std::move(skew));
      std::vector<int32_t> channels;
      for (int g = 0; g < kKvHeads; ++g) {
        for (int c = 0; c < sidecar.partial_dim; ++c) channels.push_back((c * 5 + g) % kDim);
      }
      sidecar.channels.push_back(std::move(channels));
    }
    SelectionConfig config;
    config.policy = PolicyKind::kInfinigen;
    config.dense_layers = 1;
    config.budget_fraction = 0.2;
    policy = std::move(*MakeSelectionPolicy(config, model, &sidecar));
    // The prompt's keys at layer 1, slot = position.
    std::vector<float> keys(static_cast<size_t>(n) * kKvHeads * kDim);
    for (float& x : keys) x = normal(rng);
    std::vector<int32_t> prompt_slots(static_cast<size_t>(n) * kKvHeads);
    for (int64_t t = 0; t < n; ++t) {
      for (int g = 0; g < kKvHeads; ++g) prompt_slots[t * kKvHeads + g] = static_cast<int32_t>(t);
    }
    for (int l = 1; l < layers; ++l) {
      LayerKeys k;
      k.seq = 1;
      k.layer = l;
      k.count = n;
      k.k = keys.data();
      k.k_stride = kKvHeads * kDim;
      k.slots = prompt_slots.data();
      (void)policy->OnKeys(k);
    }
    q.resize(static_cast<size_t>(kHeads) * kDim);
    for (float& x : q) x = normal(rng) * 2.0f;
    key.resize(static_cast<size_t>(kKvHeads) * kDim);
    for (float& x : key) x = normal(rng);
    slots.assign(kKvHeads, static_cast<int32_t>(n));
  }
};

// The decode token's key at slot n (OnKeys), as a decode step stores it before its Select.
void StoreCurrentKey(Setup& s, int64_t n, Shape shape, int layer = 1) {
  LayerKeys k;
  k.seq = 1;
  k.layer = layer;
  k.start = n;
  k.count = 1;
  k.k = s.key.data();
  k.k_stride = shape.kv_heads * shape.dim;
  k.slots = s.slots.data();
  (void)s.policy->OnKeys(k);
}

// The layer's Select of the decode token at position n: n + 1 rows with its own.
SelectRequest LayerRequest(const Setup& s, int64_t n, int layer = 1) {
  SelectRequest r;
  r.seq = 1;
  r.layer = layer;
  r.position = n;
  r.kv.num_slots = n + 1;
  r.speculated_q = s.q.data();
  r.current_slots = s.slots.data();
  r.q = s.q.data();
  return r;
}

void BM_InfinigenLayer(benchmark::State& state) {
  const int64_t n = state.range(0);
  Setup s(n, kLlama8B);
  Selection candidates, selection;
  int64_t rows = 0;
  for (auto _ : state) {
    SelectRequest pre = LayerRequest(s, n);  // the prefetch: the n stored rows only
    pre.kv.num_slots = n;
    pre.current_slots = nullptr;
    benchmark::DoNotOptimize(s.policy->Preselect(pre, candidates));
    StoreCurrentKey(s, n, kLlama8B);
    (void)s.policy->Select(LayerRequest(s, n), selection);
    rows += selection.all ? n + 1 : selection.count;
    benchmark::DoNotOptimize(selection.indices.data());
  }
  state.counters["rows_selected"] =
      benchmark::Counter(static_cast<double>(rows) / state.iterations());
  state.counters["stored_rows_per_s"] =
      benchmark::Counter(static_cast<double>(n) * state.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_InfinigenLayer)->Arg(2048)->Arg(8192)->Arg(32768)->Unit(benchmark::kMicrosecond);

void BM_SelectInPlace(benchmark::State& state) {
  const int64_t n = state.range(0);
  Setup s(n, kSmolLm2);
  StoreCurrentKey(s, n, kSmolLm2);
  Selection selection;
  int64_t rows = 0;
  for (auto _ : state) {
    (void)s.policy->Select(LayerRequest(s, n), selection);
    rows += selection.all ? n + 1 : selection.count;
    benchmark::DoNotOptimize(selection.indices.data());
  }
  state.counters["rows_selected"] =
      benchmark::Counter(static_cast<double>(rows) / state.iterations());
}
BENCHMARK(BM_SelectInPlace)->Arg(4096)->Arg(8192)->Unit(benchmark::kMicrosecond);

// As BM_SelectInPlace, over every sparse layer of SmolLM2-135M's 30 in turn (an iteration: one
// layer's Select; 29 layers of partial keys, 35 MiB at 8 192 rows: read from memory, as a decode
// step reads them, not from a cache that holds one layer's).
void BM_SelectInPlaceEveryLayer(benchmark::State& state) {
  const int64_t n = state.range(0);
  constexpr int kLayers = 30;
  Setup s(n, kSmolLm2, kLayers);
  for (int l = 1; l < kLayers; ++l) StoreCurrentKey(s, n, kSmolLm2, l);
  Selection selection;
  int layer = 1;
  for (auto _ : state) {
    (void)s.policy->Select(LayerRequest(s, n, layer), selection);
    benchmark::DoNotOptimize(selection.indices.data());
    layer = layer + 1 < kLayers ? layer + 1 : 1;
  }
}
BENCHMARK(BM_SelectInPlaceEveryLayer)->Arg(4096)->Arg(8192)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace infinigen

BENCHMARK_MAIN();
