// Component micro-benchmark: one layer's InfiniGen speculation (Model::SpeculatePartialQuery,
// one decode token) against that layer's Q/K/V projection (a Linear of the same shape and
// weight format), on SmolLM2 with each form of partial channels: whole RoPE pairs (the default
// sidecar), and skewed channels (the Q projection, RoPE, then A). The target: speculation
// <= 0.5x of the QKV projection. Counters: the ratio of multiply-adds (Speculation::
// MacsPerToken / QkvMacsPerToken) beside the measured times.
//
//   speculation_bench [--benchmark_repetitions=3]   (needs scripts/setup.sh's SmolLM2 GGUF)
#include <benchmark/benchmark.h>

#include <cstdio>
#include <memory>
#include <random>

#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/infinigen/prepare.h"
#include "gpu_worker/infinigen/sidecar.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/model.h"

namespace infinigen {
namespace {

std::string ModelPath() {
  const char* home = std::getenv("HOME");
  const char* cache = std::getenv("INFINIGEN_CACHE");
  return cache != nullptr ? std::string(cache) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
                          : std::string(home != nullptr ? home : "") +
                                "/.cache/infinigen/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

struct Setup {
  std::unique_ptr<Checkpoint> ckpt;
  std::unique_ptr<CpuBackend> backend;
  std::unique_ptr<Model> model;
  Weight qkv;  // random, the layer's Q/K/V shape and format
  std::vector<float> x, scratch, out, qkv_out;
  std::vector<int32_t> position = {4000};
};

std::unique_ptr<Setup> Make(bool rope_pairs, WeightFormat format) {
  auto s = std::make_unique<Setup>();
  auto ckpt = Checkpoint::Open(ModelPath());
  if (!ckpt.ok()) return nullptr;
  s->ckpt = std::move(*ckpt);
  CpuBackendOptions options;
  options.weight_format = format;
  s->backend = std::make_unique<CpuBackend>(options);
  s->model = std::move(*Model::Load(*s->ckpt, *s->backend));
  const ModelConfig& c = s->model->config();
  std::mt19937 rng(1);
  std::vector<int32_t> calibration(256);
  for (auto& t : calibration) t = static_cast<int32_t>(rng() % c.vocab_size);
  PrepareOptions po;
  po.rope_pairs = rope_pairs;
  auto sidecar = PrepareInfinigen(*s->model, *s->ckpt, calibration, po);
  if (!sidecar.ok() || !AttachSidecar(*s->model, *s->ckpt, *sidecar).ok()) return nullptr;
  std::normal_distribution<float> normal;
  const int64_t rows = c.q_dim() + 2 * c.kv_dim();
  std::vector<float> w(rows * c.hidden_size);
  for (float& v : w) v = normal(rng);
  s->qkv = std::move(*s->backend->UploadWeight(w.data(), rows, c.hidden_size));
  s->x.resize(c.hidden_size);
  for (float& v : s->x) v = normal(rng);
  s->scratch.resize(c.q_dim());
  s->out.resize(c.num_heads * s->model->speculation()->partial_dim());
  s->qkv_out.resize(rows);
  return s;
}

void BM_Speculation(benchmark::State& state) {
  auto s = Make(state.range(0) == 1, static_cast<WeightFormat>(state.range(1)));
  if (s == nullptr) {
    state.SkipWithError("SmolLM2 GGUF missing (scripts/setup.sh)");
    return;
  }
  const ModelConfig& c = s->model->config();
  const Speculation& spec = *s->model->speculation();
  const int64_t p = spec.partial_dim();
  const MatView x{s->x.data(), DType::kF32, 1, c.hidden_size, c.hidden_size};
  const MatView scratch{s->scratch.data(), DType::kF32, 1, c.q_dim(), c.q_dim()};
  const MatView out{s->out.data(), DType::kF32, 1, c.num_heads * p, c.num_heads * p};
  const int layer = 5;
  for (auto _ : state) {
    if (!s->model->SpeculatePartialQuery(layer, x, s->position.data(), scratch, out).ok()) {
      state.SkipWithError("speculation failed");
      return;
    }
    benchmark::DoNotOptimize(s->out.data());
  }
  state.counters["macs_vs_qkv"] =
      static_cast<double>(spec.MacsPerToken()) / static_cast<double>(spec.QkvMacsPerToken());
  state.SetLabel(spec.mode() == Speculation::Mode::kRopePairs ? "rope pairs"
                                                              : "skewed (Q, then A)");
}

void BM_QkvProjection(benchmark::State& state) {
  auto s = Make(true, static_cast<WeightFormat>(state.range(0)));
  if (s == nullptr) {
    state.SkipWithError("SmolLM2 GGUF missing (scripts/setup.sh)");
    return;
  }
  const ModelConfig& c = s->model->config();
  const int64_t rows = c.q_dim() + 2 * c.kv_dim();
  const MatView x{s->x.data(), DType::kF32, 1, c.hidden_size, c.hidden_size};
  const MatView y{s->qkv_out.data(), DType::kF32, 1, rows, rows};
  for (auto _ : state) {
    if (!s->backend->Linear(x, s->qkv, nullptr, y, false).ok()) {
      state.SkipWithError("linear failed");
      return;
    }
    benchmark::DoNotOptimize(s->qkv_out.data());
  }
}

// Args: {rope pairs?, weight format}; formats 0 = f32, 3 = q8 (WeightFormat).
BENCHMARK(BM_Speculation)->Args({1, 3})->Args({0, 3})->Args({1, 0})->Args({0, 0});
BENCHMARK(BM_QkvProjection)->Arg(3)->Arg(0);

}  // namespace
}  // namespace infinigen

BENCHMARK_MAIN();
