// Decode throughput and time per output token through a running infinigen-worker (and its KV
// store), or through the local engine in this process (BatchEngine over a resident KV cache:
// the same batching and model code without the service, the store or a transport), for the
// service-path overhead of docs/benchmarks.md. --policy applies to both: the local engine runs
// it as the worker does with its default flags (infinigen: the sidecar next to the model).
//
// usage: worker_bench (--target HOST:PORT | --local MODEL [--threads N --cpu-weights q8
//                                                          --cpu-kv f32|bf16])
//            [--streams 1,4,16] [--prompt-tokens 128] [--new-tokens 64] [--policy full]
//
// The local engine can also run a model of random weights (--random CONFIG.json: a Hugging Face
// Llama config, e.g. scripts/gpu/llama31_8b.json; InfiniGen gets a sidecar of 26 channels as
// whole RoPE pairs), on the GPU (--device cuda [--cuda-dtype bf16]) or on the tests' CPU
// stand-in of one (--device device-like: the GPU's decode path, its rows planned on the
// "device", checked before a GPU runs it), over the KV store as the
// worker and `infinigen serve` run it (--kv store: StoreKvCache over an in-process store of
// --kv-capacity-mb; --kv-device-gather true|false: the GPU reads the rows from the store's
// memory, the default, or the store copies them into staging; --kv-resident-layers N keeps the
// first N layers' K/V on the device too, by default InfiniGen's dense layers as the worker does
// and none for other policies) instead of the resident cache
// (--kv resident, the all-on-device baseline); --kv-row-reuse true|false (with InfiniGen over
// the store where the GPU gathers: each sequence keeps its last prefetched rows on the device,
// the worker's default; --kv-device-plan true|false: those rows planned on the GPU, no wait
// between layers, the worker's default, or on the host) and a `link` row per case: KV MiB moved
// over the link and read where the device kept them, per generated token, and the reused fraction;
// --prefill-budget sets the engine's prompt tokens per step (a whole long prompt in one step: its
// K/V are not read back). Each case starts `streams` requests at once (random prompt ids, greedy,
// EOS ignored) and waits for all; tokens/s = generated tokens / wall time of the case; TPOT = the
// gaps between consecutive tokens of a stream after its first, over all streams (p50, p99). One
// markdown row per case.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "gpu_worker/engine/batch_engine.h"
#include "gpu_worker/infinigen/infinigen_policy.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "gpu_worker/kv/store_kv_cache.h"
#include "gpu_worker/model/loaded_model.h"
#include "gpu_worker/service/worker_runtime.h"
#include "infinigen/worker/v1/worker.grpc.pb.h"
#include "kv_store/client/kv_store_client.h"
#if INFINIGEN_BENCH_DEVICE_LIKE
#include "tests/support/device_like_backend.h"
#endif

namespace {

using namespace infinigen;  // NOLINT
using Clock = std::chrono::steady_clock;

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

struct CaseResult {
  int64_t tokens = 0;
  double seconds = 0;
  std::vector<double> gaps;   // seconds between consecutive tokens of a stream
  std::vector<double> ttfts;  // seconds from the start (all streams at once) to a first token
  int errors = 0;
};

// Fills the totals and the token gaps of `r` from each stream's token arrival times.
void Summarize(const std::vector<std::vector<Clock::time_point>>& arrivals,
               const std::vector<int>& failed, Clock::time_point t0, CaseResult& r) {
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  for (size_t s = 0; s < arrivals.size(); ++s) {
    r.errors += failed[s];
    r.tokens += static_cast<int64_t>(arrivals[s].size());
    if (!arrivals[s].empty()) {
      r.ttfts.push_back(std::chrono::duration<double>(arrivals[s][0] - t0).count());
    }
    for (size_t i = 1; i < arrivals[s].size(); ++i) {
      r.gaps.push_back(std::chrono::duration<double>(arrivals[s][i] - arrivals[s][i - 1]).count());
    }
  }
}

std::vector<int32_t> Prompt(int64_t n, int64_t vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

CaseResult RunRemote(worker::v1::Worker::Stub& stub, int streams, int64_t vocab, int64_t prompt,
                     int64_t new_tokens, const std::string& policy) {
  CaseResult r;
  std::vector<std::vector<Clock::time_point>> arrivals(streams);
  std::vector<int> failed(streams, 0);
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (int s = 0; s < streams; ++s) {
    threads.emplace_back([&, s] {
      worker::v1::GenerateRequest req;
      for (int32_t t : Prompt(prompt, vocab, 1000 + s)) req.mutable_token_ids()->add_ids(t);
      req.mutable_sampling()->set_temperature(0);
      req.mutable_stopping()->set_max_new_tokens(static_cast<int32_t>(new_tokens));
      req.mutable_stopping()->set_ignore_eos(true);
      if (!policy.empty()) req.mutable_selection()->set_policy(policy);
      grpc::ClientContext ctx;
      auto reader = stub.Generate(&ctx, req);
      worker::v1::GenerateResponse msg;
      while (reader->Read(&msg)) {
        for (int i = 0; i < msg.token_ids_size(); ++i) arrivals[s].push_back(Clock::now());
      }
      auto st = reader->Finish();
      if (!st.ok()) {
        std::fprintf(stderr, "stream %d: %s\n", s, st.error_message().c_str());
        failed[s] = 1;
      }
    });
  }
  for (auto& t : threads) t.join();
  Summarize(arrivals, failed, t0, r);
  return r;
}

// `make_policy` gives each request its KV selection (null: dense), as the worker does.
using PolicyFactory = std::function<absl::StatusOr<std::unique_ptr<KvSelectionPolicy>>()>;

CaseResult RunLocal(BatchEngine& engine, int streams, int64_t vocab, int64_t prompt,
                    int64_t new_tokens, const PolicyFactory& make_policy) {
  CaseResult r;
  std::vector<std::vector<Clock::time_point>> arrivals(streams);
  std::vector<absl::Notification> done(streams);
  std::vector<int> failed(streams, 0);
  const auto t0 = Clock::now();
  for (int s = 0; s < streams; ++s) {
    EngineRequest req;
    req.prompt = Prompt(prompt, vocab, 1000 + s);
    req.options.max_new_tokens = new_tokens;
    req.options.ignore_eos = true;
    req.options.sampling.temperature = 0;
    auto policy = make_policy();
    if (!policy.ok()) {
      std::fprintf(stderr, "policy: %s\n", std::string(policy.status().message()).c_str());
      std::exit(1);
    }
    req.policy = std::move(*policy);
    auto id = engine.Submit(std::move(req), [&, s](const EngineEvent& e) {
      if (e.token >= 0) arrivals[s].push_back(Clock::now());
      if (e.done) {
        failed[s] = e.status.ok() ? 0 : 1;
        done[s].Notify();
      }
    });
    if (!id.ok()) {
      failed[s] = 1;
      done[s].Notify();
    }
  }
  for (auto& d : done) d.WaitForNotification();
  Summarize(arrivals, failed, t0, r);
  return r;
}

// One line, "profile | label | streams | ...": the decode-only steps of a case with every stream
// in them (engine counters after minus before; the streams that are left after the first ones
// end are not the case's batch): how many and their mean batch, per step in ms, and the
// backend's copies and waits per layer.
void PrintProfile(const std::string& label, int streams, const StepProfile& a,
                  const StepProfile& b) {
  const double steps = static_cast<double>(b.steps - a.steps);
  const double layers = static_cast<double>(b.layers - a.layers);
  if (steps <= 0) return;
  auto ms = [&](double StepProfile::*phase) { return 1e3 * (b.*phase - a.*phase) / steps; };
  const BackendCounters c = b.backend - a.backend;
  const double phases = ms(&StepProfile::speculate) + ms(&StepProfile::preselect) +
                        ms(&StepProfile::prefetch) + ms(&StepProfile::append) +
                        ms(&StepProfile::select) + ms(&StepProfile::fetch) +
                        ms(&StepProfile::attend);
  std::printf(
      "profile | %s | %d | %.0f | %.1f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | "
      "%.2f | "
      "%.2f | %.1f | %.1f | %.1f | %.1f |\n",
      label.c_str(), streams, steps, static_cast<double>(b.sequences - a.sequences) / steps,
      ms(&StepProfile::total), ms(&StepProfile::speculate), ms(&StepProfile::preselect),
      ms(&StepProfile::prefetch), ms(&StepProfile::append), ms(&StepProfile::select),
      ms(&StepProfile::fetch), ms(&StepProfile::fetch_wait), ms(&StepProfile::attend),
      ms(&StepProfile::total) - phases, c.synchronizations / layers, c.copies_to_host / layers,
      c.copies_to_device / layers, c.allocations / steps);
}

}  // namespace

// Partial channels of a random-weight model: the first 13 RoPE pairs (26 channels) of every KV
// head, unskewed (InfiniGen's selection then costs what it costs on a real model; which rows it
// picks on random weights says nothing about accuracy).
InfinigenSidecar RopePairSidecar(const ModelConfig& c) {
  InfinigenSidecar s;
  const int d = static_cast<int>(c.head_dim), kv = static_cast<int>(c.num_kv_heads);
  s.partial_dim = std::min(26, d - d % 2);
  s.ratio = static_cast<float>(s.partial_dim) / d;
  s.skewed = false;
  s.rope_pairs = true;
  s.num_layers = static_cast<int>(c.num_layers);
  s.num_kv_heads = kv;
  s.head_dim = d;
  for (int l = 0; l < s.num_layers; ++l) {
    std::vector<float> skew(static_cast<size_t>(kv) * d * d, 0.0f);
    std::vector<int32_t> channels;
    for (int g = 0; g < kv; ++g) {
      for (int i = 0; i < d; ++i) skew[(static_cast<size_t>(g) * d + i) * d + i] = 1.0f;
      for (int i = 0; i < s.partial_dim / 2; ++i) channels.push_back(i);
      for (int i = 0; i < s.partial_dim / 2; ++i) {
        channels.push_back(RopePartner(i, c.rope.rotary_dim, c.rope.layout));
      }
    }
    s.skew.push_back(std::move(skew));
    s.channels.push_back(std::move(channels));
  }
  return s;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int main(int argc, char** argv) {
  std::string target, local, random, streams_list = "1,4,16", policy, label, cpu_weights = "q8";
  std::string device = "cpu", cuda_dtype = "bf16", kv = "resident", cpu_kv = "f32";
  int64_t prompt = 128, new_tokens = 64, threads = 0, kv_capacity_mb = 4096, prefill_budget = 256;
  bool kv_device_gather = true, kv_row_reuse = true, kv_device_plan = true;
  bool fail_on_errors = false;      // exit 1 when a request failed (or a device plan was not made)
  int64_t kv_resident_layers = -1;  // -1: as the worker (InfiniGen's dense layers on a GPU)
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--target")
      target = v;
    else if (k == "--local")
      local = v;
    else if (k == "--streams")
      streams_list = v;
    else if (k == "--policy")
      policy = v;
    else if (k == "--label")
      label = v;
    else if (k == "--cpu-weights")
      cpu_weights = v;
    else if (k == "--cpu-kv")
      cpu_kv = v;
    else if (k == "--prompt-tokens")
      (void)absl::SimpleAtoi(v, &prompt);
    else if (k == "--new-tokens")
      (void)absl::SimpleAtoi(v, &new_tokens);
    else if (k == "--threads")
      (void)absl::SimpleAtoi(v, &threads);
    else if (k == "--random")
      random = v;
    else if (k == "--device")
      device = v;
    else if (k == "--cuda-dtype")
      cuda_dtype = v;
    else if (k == "--kv")
      kv = v;
    else if (k == "--kv-capacity-mb")
      (void)absl::SimpleAtoi(v, &kv_capacity_mb);
    else if (k == "--kv-device-gather")
      kv_device_gather = v == "true" || v == "1";
    else if (k == "--kv-row-reuse")
      kv_row_reuse = v == "true" || v == "1";
    else if (k == "--kv-device-plan")
      kv_device_plan = v == "true" || v == "1";
    else if (k == "--kv-resident-layers")
      (void)absl::SimpleAtoi(v, &kv_resident_layers);
    else if (k == "--prefill-budget")
      (void)absl::SimpleAtoi(v, &prefill_budget);
    else if (k == "--fail-on-errors")
      fail_on_errors = v == "true" || v == "1";
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  if (int(!target.empty()) + int(!local.empty()) + int(!random.empty()) != 1) {
    std::fprintf(stderr,
                 "give exactly one of --target HOST:PORT, --local MODEL and --random CONFIG\n");
    return 2;
  }
  if (device == "device-like" && random.empty()) {
    std::fprintf(stderr, "--device device-like runs --random models only\n");
    return 2;
  }
  if (kv != "resident" && kv != "store") {
    std::fprintf(stderr, "--kv must be resident or store\n");
    return 2;
  }
  std::vector<int> streams;
  for (absl::string_view s : absl::StrSplit(streams_list, ',')) {
    int n = 0;
    if (absl::SimpleAtoi(s, &n) && n > 0) streams.push_back(n);
  }
  if (label.empty()) label = target.empty() ? "local engine" : target;

  std::unique_ptr<worker::v1::Worker::Stub> stub;
  LoadedModel loaded;
  std::unique_ptr<KvStore> store;
  std::unique_ptr<KvStoreClient> client;
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<BatchEngine> engine;
  std::unique_ptr<InfinigenSidecar> sidecar;
  std::shared_ptr<const PartialSkewOnBackend> skew_on_backend;
  PolicyFactory make_policy;
  int64_t vocab = 0;
  if (!target.empty()) {
    stub = worker::v1::Worker::NewStub(
        grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    worker::v1::InfoResponse info;
    auto st = stub->Info(&ctx, worker::v1::InfoRequest(), &info);
    if (!st.ok()) {
      std::fprintf(stderr, "Info: %s\n", st.error_message().c_str());
      return 1;
    }
    vocab = info.vocab_size();
  } else {
    BackendSpec flags;
    flags.threads = threads;
    flags.cpu_weights = cpu_weights;
    flags.cpu_kv = cpu_kv;
    flags.device = device;
    flags.cuda_dtype = cuda_dtype;
    auto fail = [](const absl::Status& st) {
      std::fprintf(stderr, "%s\n", std::string(st.message()).c_str());
      return 1;
    };
    if (!random.empty()) {
      auto config = ParseHfConfig(ReadFile(random), random);
      if (!config.ok()) return fail(config.status());
#if INFINIGEN_BENCH_DEVICE_LIKE
      if (device == "device-like") {  // the GPU's path on the tests' CPU stand-in of a device
        flags.device = "cpu";
        auto options = flags.Options();
        if (!options.ok()) return fail(options.status());
        loaded.backend = std::make_unique<testing::DeviceLikeCpuBackend>(*options);
      }
#endif
      if (loaded.backend == nullptr) {
        auto backend = flags.Create();
        if (!backend.ok()) return fail(backend.status());
        loaded.backend = std::move(*backend);
      }
      auto model = Model::LoadRandom(*config, *loaded.backend, 1);
      if (!model.ok()) return fail(model.status());
      loaded.model = std::move(*model);
    } else {
      auto l = LoadModel(local, flags);
      if (!l.ok()) return fail(l.status());
      loaded = std::move(*l);
    }
    vocab = loaded.model->config().vocab_size;
    if (kv == "store") {
      KvStoreConfig sc;
      sc.capacity_bytes = static_cast<size_t>(kv_capacity_mb) << 20;
      sc.shared_memory = false;
      sc.prefault_ahead_bytes = kServedPrefaultAheadBytes;  // as the worker's in-process store
      auto s = KvStore::Create(sc);
      if (!s.ok()) return fail(s.status());
      store = std::move(*s);
      KvClientConfig cc;
      cc.transport = KvClientConfig::Transport::kInProcess;
      cc.store = store.get();
      auto c = MakeKvStoreClient(cc);
      if (!c.ok()) return fail(c.status());
      client = std::move(*c);
      StoreKvCacheOptions options;
      options.device_reads_mapped_rows = kv_device_gather;
      WorkerConfig as_worker;
      if (kv_row_reuse && policy == "infinigen") {
        options.reuse_rows = ReuseRowsFor(as_worker.Selection(true));
        options.plan_on_device = kv_device_plan;
      }
      options.device_resident_layers =
          kv_resident_layers >= 0 ? static_cast<int>(kv_resident_layers)
                                  : (policy == "infinigen" && as_worker.kv_resident_dense_layers
                                         ? as_worker.Selection(true).dense_layers
                                         : 0);
      cache = std::make_unique<StoreKvCache>(*loaded.backend, loaded.model->kv_shape(), *client,
                                             options);
    } else {
      cache = std::make_unique<BackendKvCache>(*loaded.backend, loaded.model->kv_shape());
    }
    // The policy as the worker would run it with its default flags and the model's sidecar.
    WorkerConfig defaults;
    defaults.policy = policy.empty() ? "full" : policy;
    if (defaults.policy == "infinigen") {
      if (!random.empty()) {
        sidecar = std::make_unique<InfinigenSidecar>(RopePairSidecar(loaded.model->config()));
        if (auto st = loaded.model->AttachSpeculation(PartialChannelsOf(*sidecar)); !st.ok()) {
          return fail(st);
        }
      } else {
        auto s = ReadSidecar(DefaultSidecarPath(local), *loaded.checkpoint);
        if (!s.ok()) return fail(s.status());
        sidecar = std::make_unique<InfinigenSidecar>(std::move(*s));
        if (auto st = AttachSidecar(*loaded.model, *loaded.checkpoint, *sidecar); !st.ok()) {
          return fail(st);
        }
      }
    }
    const SelectionConfig selection = defaults.Selection(sidecar != nullptr);
    // As the worker: InfiniGen chooses rows in the GPU's memory (worker_runtime.cc).
    if (sidecar != nullptr && !loaded.backend->host_accessible()) {
      auto skew = UploadPartialSkew(*sidecar, *loaded.backend);
      if (!skew.ok()) return fail(skew.status());
      skew_on_backend = *skew;
    }
    make_policy = [&, selection]() -> absl::StatusOr<std::unique_ptr<KvSelectionPolicy>> {
      if (selection.policy == PolicyKind::kFull) return std::unique_ptr<KvSelectionPolicy>();
      return MakeSelectionPolicy(selection, loaded.model->config(), sidecar.get(), skew_on_backend);
    };
    EngineConfig ec;
    ec.max_running = 64;
    ec.prefill_budget_tokens = prefill_budget;
    engine = std::make_unique<BatchEngine>(*loaded.model, *cache, ec);
  }
  // Warm-up: one short request.
  if (stub) {
    RunRemote(*stub, 1, vocab, 16, 4, policy);
  } else {
    RunLocal(*engine, 1, vocab, 16, 4, make_policy);
  }
  int failed = 0;
  if (fail_on_errors && policy == "infinigen" && kv == "store" && kv_row_reuse && kv_device_plan &&
      loaded.backend != nullptr && !loaded.backend->host_accessible()) {
    const auto* store_cache = dynamic_cast<const StoreKvCache*>(cache.get());
    if (store_cache == nullptr || !store_cache->plans_on_device()) {
      std::fprintf(stderr, "the rows are not planned on the device\n");
      ++failed;
    }
  }
  for (int n : streams) {
    if (engine) engine->ProfileStepsOfAtLeast(n);  // the case's batch, not its stragglers
    const EngineStats stats_before = engine ? engine->Stats() : EngineStats();
    const StepProfile before = stats_before.decode_profile;
    CaseResult r = stub ? RunRemote(*stub, n, vocab, prompt, new_tokens, policy)
                        : RunLocal(*engine, n, vocab, prompt, new_tokens, make_policy);
    if (engine) {
      const EngineStats stats = engine->Stats();
      PrintProfile(label, n, before, stats.decode_profile);
      // KV bytes over the link (fetched) and read where the device kept them (reused), per
      // generated token of this case (its prefills' reads included), of its finished requests.
      const double tokens = std::max<double>(1, static_cast<double>(r.tokens));
      const double fetched = static_cast<double>(stats.bytes_fetched - stats_before.bytes_fetched);
      const double reused = static_cast<double>(stats.bytes_reused - stats_before.bytes_reused);
      std::printf("link | %s | %d | %.3f | %.3f | %.3f |\n", label.c_str(), n,
                  fetched / tokens / (1 << 20), reused / tokens / (1 << 20),
                  fetched + reused > 0 ? reused / (fetched + reused) : 0.0);
    }
    std::printf("| %s | %d | %.1f | %.2f | %.2f | %d |\n", label.c_str(), n,
                static_cast<double>(r.tokens) / r.seconds, 1e3 * Percentile(r.gaps, 0.5),
                1e3 * Percentile(r.gaps, 0.99), r.errors);
    // Time to first token (s), every stream submitted at once: the last waits for every prefill.
    std::printf("ttft | %s | %d | %.3f | %.3f |\n", label.c_str(), n, Percentile(r.ttfts, 0.5),
                Percentile(r.ttfts, 1.0));
    std::fflush(stdout);
    failed += r.errors;
  }
  return fail_on_errors && failed > 0 ? 1 : 0;
}
