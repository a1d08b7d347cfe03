// KV bytes the served decode path moves over the host link where a GPU gathers rows from the KV
// store (StoreKvCacheOptions::device_reads_mapped_rows), with row reuse (the worker's default,
// --kv-row-reuse) against without, on a real checkpoint and real text. Counted on the CPU
// stand-in of that path: testing::DeviceLikeCpuBackend, the CPU backend presented as a device
// whose memory the host cannot read, under the product's own BatchEngine, DecodeStep,
// StoreKvCache and in-process KV store, with InfiniGen choosing rows on the "device" as on a GPU
// (its partial keys, the worker's default selection, dense layers kept resident). Which rows a
// step lists, and so the bytes, do not depend on how fast the device is: this is a component
// measurement of data movement, not of time (docs/benchmarks.md). Each case decodes the same
// greedy streams both ways and says whether their tokens agree.
// --backend cpu --transport grpc measures the other place reuse applies, on this machine as it
// is: a CPU worker whose store is another service (here behind a real gRPC server on
// 127.0.0.1 in this process), the transport copying each prefetch's rows; there the time per
// output token is the product's, and the row gives it too.
//
// usage: kv_reuse_bench --local MODEL --text FILE [--prompt-tokens 2048,4096] [--new-tokens 64]
//            [--streams 1] [--threads 0] [--backend device-like|cpu]
//            [--transport in-process|grpc|shm] [--device-plan false|true]
// One markdown row per case: prompt tokens, streams, MiB moved per generated token without and
// with reuse, their ratio, the fraction of listed rows found kept, whether tokens agree, and
// the median time between a stream's tokens without and with reuse (ms).
// --device-plan true (device-like backend only) also runs reuse with the rows planned on the
// "device" (StoreKvCacheOptions::plan_on_device, the worker's default on a GPU) and prints a
// second table: the backend's waits per token decoded once every prompt was prefilled (and the
// device plan's store waits for block tables), and the bytes, for the host's plan and the device's,
// and whether all three runs' tokens agree (a real model's choices, where the tests' fixtures have
// 2 layers: a plan that did not fit fails the run).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "common/status_macros.h"
#include "gpu_worker/engine/batch_engine.h"
#include "gpu_worker/infinigen/infinigen_policy.h"
#include "gpu_worker/infinigen/sidecar.h"
#include "gpu_worker/kv/store_kv_cache.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/loaded_model.h"
#include "gpu_worker/service/worker_runtime.h"
#include "kv_store/client/kv_store_client.h"
#include "kv_store/kv_store.h"
#include "kv_store/service/kvstore_service.h"
#include "tests/support/device_like_backend.h"

namespace infinigen {
namespace {

struct Run {
  std::vector<std::vector<int32_t>> tokens;
  int64_t generated = 0, fetched = 0, reused = 0;
  double tpot_ms = 0;  // median gap between a stream's consecutive tokens
  // The backend's waits (synchronizations) and the tokens generated once every stream had its
  // first (its prompt prefilled): the decode steps'.
  int64_t decode_waits = 0, decode_tokens = 0;
  // ... and the store calls waited for to learn the block tables of rows planned on the device
  // (StoreKvCache::table_waits) in those steps.
  int64_t decode_table_waits = 0;
  double decode_table_wait_ms = 0;  // ... and the time they took
};

int Fail(const absl::Status& st) {
  std::fprintf(stderr, "kv_reuse_bench: %s\n", st.ToString().c_str());
  return 1;
}

}  // namespace
}  // namespace infinigen

int main(int argc, char** argv) {
  using namespace infinigen;
  std::string local, text_path, prompts_list = "2048,4096", backend_name = "device-like",
                                transport = "in-process";
  int64_t new_tokens = 64, streams = 1, threads = 0;
  bool device_plan = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--local") {
      local = v;
    } else if (k == "--text") {
      text_path = v;
    } else if (k == "--prompt-tokens") {
      prompts_list = v;
    } else if (k == "--new-tokens") {
      (void)absl::SimpleAtoi(v, &new_tokens);
    } else if (k == "--streams") {
      (void)absl::SimpleAtoi(v, &streams);
    } else if (k == "--threads") {
      (void)absl::SimpleAtoi(v, &threads);
    } else if (k == "--backend") {
      backend_name = v;
    } else if (k == "--transport") {
      transport = v;
    } else if (k == "--device-plan") {
      device_plan = v == "true" || v == "1";
    } else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  if (local.empty() || text_path.empty()) {
    std::fprintf(stderr, "give --local MODEL and --text FILE\n");
    return 2;
  }
  if ((backend_name != "device-like" && backend_name != "cpu") ||
      (transport != "in-process" && transport != "grpc" && transport != "shm")) {
    std::fprintf(stderr, "--backend device-like|cpu, --transport in-process|grpc|shm\n");
    return 2;
  }
  const bool on_device = backend_name == "device-like";
  auto ckpt = Checkpoint::Open(local);
  if (!ckpt.ok()) return Fail(ckpt.status());
  auto tokenizer = LoadTokenizer(**ckpt);
  if (!tokenizer.ok()) return Fail(tokenizer.status());
  std::ifstream in(text_path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::vector<int32_t> text = (*tokenizer)->Encode(ss.str());
  CpuBackendOptions cpu;  // q8 weights and bf16 K/V, as the main job serves on the CPU
  cpu.num_threads = static_cast<int>(threads);
  cpu.weight_format = WeightFormat::kQ8;
  cpu.kv_dtype = DType::kBF16;
  std::unique_ptr<CpuBackend> owned = on_device
                                          ? std::make_unique<testing::DeviceLikeCpuBackend>(cpu)
                                          : std::make_unique<CpuBackend>(cpu);
  CpuBackend& device = *owned;
  auto model = Model::Load(**ckpt, device);
  if (!model.ok()) return Fail(model.status());
  auto sidecar = ReadSidecar(DefaultSidecarPath(local), **ckpt);
  if (!sidecar.ok()) return Fail(sidecar.status());
  if (auto st = AttachSidecar(**model, **ckpt, *sidecar); !st.ok()) return Fail(st);
  // InfiniGen chooses rows in the "device"'s memory there, on the host on the CPU.
  std::shared_ptr<const PartialSkewOnBackend> skew;
  if (on_device) {
    auto uploaded = UploadPartialSkew(*sidecar, device);
    if (!uploaded.ok()) return Fail(uploaded.status());
    skew = *uploaded;
  }
  const SelectionConfig selection = WorkerConfig().Selection(true);

  if (device_plan && !on_device) {
    std::fprintf(stderr, "--device-plan needs --backend device-like\n");
    return 2;
  }
  auto run = [&](int64_t prompt, bool reuse, bool plan) -> absl::StatusOr<Run> {
    KvStoreConfig sc;
    sc.capacity_bytes = size_t{2} << 30;
    sc.shared_memory = transport == "shm";
    sc.huge_pages = false;
    IG_ASSIGN_OR_RETURN(std::unique_ptr<KvStore> store, KvStore::Create(sc));
    KvClientConfig cc;
    std::unique_ptr<KvStoreService> service;
    std::unique_ptr<grpc::Server> server;
    if (transport != "in-process") {  // the store behind a real gRPC server on 127.0.0.1
      service = std::make_unique<KvStoreService>(*store);
      grpc::ServerBuilder builder;
      int port = 0;
      builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
      builder.SetMaxReceiveMessageSize(256 << 20);
      builder.RegisterService(service.get());
      server = builder.BuildAndStart();
      if (port == 0) return absl::UnavailableError("no port for the store");
      // shm: the arena mapped here, the answers over gRPC (a worker beside its store).
      cc.transport =
          transport == "shm" ? KvClientConfig::Transport::kShm : KvClientConfig::Transport::kGrpc;
      cc.address = "127.0.0.1:" + std::to_string(port);
    } else {
      cc.transport = KvClientConfig::Transport::kInProcess;
      cc.store = store.get();
    }
    IG_ASSIGN_OR_RETURN(std::unique_ptr<KvStoreClient> client, MakeKvStoreClient(cc));
    StoreKvCacheOptions options;  // as the worker sets them on a GPU (worker_runtime.cc)
    options.device_reads_mapped_rows = true;
    options.device_resident_layers = selection.dense_layers;
    if (reuse) options.reuse_rows = ReuseRowsFor(selection);
    options.plan_on_device = plan;
    StoreKvCache cache(device, (*model)->kv_shape(), *client, options);
    if (on_device && !cache.device_gathers()) {
      return absl::InternalError("the stand-in does not gather");
    }
    if (plan && !cache.plans_on_device()) {
      return absl::InternalError("the stand-in does not plan on the device");
    }
    EngineConfig ec;
    ec.prefill_budget_tokens = prompt;
    BatchEngine engine(**model, cache, ec);
    // Read in the engine's callbacks (one thread; the backend's counters are atomic).
    int64_t started = 0, generated = 0, waits_at_start = 0, generated_at_start = 0,
            table_waits_at_start = 0;
    double table_wait_at_start = 0;
    Run r;
    r.tokens.resize(static_cast<size_t>(streams));
    std::vector<std::vector<std::chrono::steady_clock::time_point>> at(
        static_cast<size_t>(streams));
    std::vector<absl::Notification> done(static_cast<size_t>(streams));
    std::vector<absl::Status> status(static_cast<size_t>(streams));
    for (int64_t s = 0; s < streams; ++s) {
      EngineRequest req;
      // Stream s reads the text from its own place.
      const size_t from = static_cast<size_t>(s * 7919) % (text.size() - prompt);
      req.prompt.assign(text.begin() + from, text.begin() + from + prompt);
      req.options.max_new_tokens = new_tokens;
      req.options.ignore_eos = true;
      req.options.sampling.temperature = 0;
      IG_ASSIGN_OR_RETURN(req.policy,
                          MakeSelectionPolicy(selection, (*model)->config(), &*sidecar, skew));
      IG_RETURN_IF_ERROR(engine
                             .Submit(std::move(req),
                                     [&, s](const EngineEvent& e) {
                                       if (e.token >= 0) {
                                         ++generated;
                                         if (r.tokens[s].empty() && ++started == streams) {
                                           waits_at_start = device.counters().synchronizations;
                                           table_waits_at_start = cache.table_waits();
                                           table_wait_at_start = cache.table_wait_seconds();
                                           generated_at_start = generated;
                                         }
                                         r.tokens[s].push_back(e.token);
                                         at[s].push_back(std::chrono::steady_clock::now());
                                       }
                                       if (e.done) {
                                         status[s] = e.status;
                                         done[s].Notify();
                                       }
                                     })
                             .status());
    }
    for (auto& d : done) d.WaitForNotification();
    for (const absl::Status& st : status) IG_RETURN_IF_ERROR(st);
    std::vector<double> gaps;
    for (const auto& times : at) {
      for (size_t i = 1; i < times.size(); ++i) {
        gaps.push_back(std::chrono::duration<double, std::milli>(times[i] - times[i - 1]).count());
      }
    }
    if (!gaps.empty()) {
      std::nth_element(gaps.begin(), gaps.begin() + gaps.size() / 2, gaps.end());
      r.tpot_ms = gaps[gaps.size() / 2];
    }
    r.decode_waits = device.counters().synchronizations - waits_at_start;
    r.decode_tokens = generated - generated_at_start;
    r.decode_table_waits = cache.table_waits() - table_waits_at_start;
    r.decode_table_wait_ms = 1e3 * (cache.table_wait_seconds() - table_wait_at_start);
    const EngineStats stats = engine.Stats();
    for (const auto& t : r.tokens) r.generated += static_cast<int64_t>(t.size());
    r.fetched = stats.bytes_fetched;
    r.reused = stats.bytes_reused;
    return r;
  };

  std::printf("%s backend, %s transport\n", backend_name.c_str(), transport.c_str());
  std::printf(
      "| prompt tokens | streams | MiB moved per token, no reuse | with reuse | ratio | "
      "listed rows found kept | tokens agree | TPOT p50 (ms), no reuse | with reuse |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---|---:|---:|\n");
  std::string planned_rows;  // the second table's
  for (absl::string_view p : absl::StrSplit(prompts_list, ',')) {
    int64_t prompt = 0;
    if (!absl::SimpleAtoi(p, &prompt) || prompt <= 0 ||
        prompt >= static_cast<int64_t>(text.size())) {
      std::fprintf(stderr, "bad --prompt-tokens entry %s\n", std::string(p).c_str());
      return 2;
    }
    auto plain = run(prompt, false, false);
    if (!plain.ok()) return Fail(plain.status());
    auto reused = run(prompt, true, false);
    if (!reused.ok()) return Fail(reused.status());
    const double mib = 1 << 20;
    auto per_token = [&](const Run& r, int64_t n) {
      return static_cast<double>(n) / static_cast<double>(std::max<int64_t>(1, r.generated));
    };
    const double a = per_token(*plain, plain->fetched) / mib;
    const double b = per_token(*reused, reused->fetched) / mib;
    const double kept = static_cast<double>(reused->reused) /
                        static_cast<double>(std::max<int64_t>(1, reused->reused + reused->fetched));
    std::printf("| %lld | %lld | %.3f | %.3f | %.3f | %.3f | %s | %.2f | %.2f |\n",
                static_cast<long long>(prompt), static_cast<long long>(streams), a, b, b / a, kept,
                plain->tokens == reused->tokens ? "yes" : "NO", plain->tpot_ms, reused->tpot_ms);
    std::fflush(stdout);
    if (!device_plan) continue;
    auto planned = run(prompt, true, true);
    if (!planned.ok()) return Fail(planned.status());
    const double decoded = static_cast<double>(std::max<int64_t>(1, planned->decode_tokens));
    planned_rows += absl::StrFormat(
        "| %d | %d | %.2f | %.2f | %.2f | %.3f | %.3f | %.3f | %s |\n", prompt, streams,
        static_cast<double>(reused->decode_waits) / std::max<int64_t>(1, reused->decode_tokens),
        static_cast<double>(planned->decode_waits) / decoded,
        static_cast<double>(planned->decode_table_waits) / decoded,
        planned->decode_table_wait_ms / decoded, b, per_token(*planned, planned->fetched) / mib,
        planned->tokens == reused->tokens && planned->tokens == plain->tokens ? "yes" : "NO");
  }
  if (device_plan) {
    std::printf(
        "\nrows planned on the device (with reuse)\n"
        "| prompt tokens | streams | backend waits per decoded token, host plan | device plan | "
        "store waits for block tables per decoded token, device plan | their ms per decoded "
        "token | MiB moved per token, host plan | device plan | tokens agree (all three) |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|\n%s",
        planned_rows.c_str());
  }
  return 0;
}
