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
//
// usage: kv_reuse_bench --local MODEL --text FILE [--prompt-tokens 2048,4096] [--new-tokens 64]
//            [--streams 1] [--threads 0]
// One markdown row per case: prompt tokens, streams, MiB moved per generated token without and
// with reuse, their ratio, the fraction of listed rows found kept, and whether tokens agree.
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
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
#include "tests/support/device_like_backend.h"

namespace infinigen {
namespace {

struct Run {
  std::vector<std::vector<int32_t>> tokens;
  int64_t generated = 0, fetched = 0, reused = 0;
};

int Fail(const absl::Status& st) {
  std::fprintf(stderr, "kv_reuse_bench: %s\n", st.ToString().c_str());
  return 1;
}

}  // namespace
}  // namespace infinigen

int main(int argc, char** argv) {
  using namespace infinigen;
  std::string local, text_path, prompts_list = "2048,4096";
  int64_t new_tokens = 64, streams = 1, threads = 0;
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
    } else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  if (local.empty() || text_path.empty()) {
    std::fprintf(stderr, "give --local MODEL and --text FILE\n");
    return 2;
  }
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
  testing::DeviceLikeCpuBackend device(cpu);
  auto model = Model::Load(**ckpt, device);
  if (!model.ok()) return Fail(model.status());
  auto sidecar = ReadSidecar(DefaultSidecarPath(local), **ckpt);
  if (!sidecar.ok()) return Fail(sidecar.status());
  if (auto st = AttachSidecar(**model, **ckpt, *sidecar); !st.ok()) return Fail(st);
  auto skew = UploadPartialSkew(*sidecar, device);
  if (!skew.ok()) return Fail(skew.status());
  const SelectionConfig selection = WorkerConfig().Selection(true);

  auto run = [&](int64_t prompt, bool reuse) -> absl::StatusOr<Run> {
    KvStoreConfig sc;
    sc.capacity_bytes = size_t{2} << 30;
    sc.shared_memory = false;
    IG_ASSIGN_OR_RETURN(std::unique_ptr<KvStore> store, KvStore::Create(sc));
    KvClientConfig cc;
    cc.transport = KvClientConfig::Transport::kInProcess;
    cc.store = store.get();
    IG_ASSIGN_OR_RETURN(std::unique_ptr<KvStoreClient> client, MakeKvStoreClient(cc));
    StoreKvCacheOptions options;  // as the worker sets them on a GPU (worker_runtime.cc)
    options.device_reads_mapped_rows = true;
    options.device_resident_layers = selection.dense_layers;
    if (reuse) options.reuse_rows = ReuseRowsFor(selection);
    StoreKvCache cache(device, (*model)->kv_shape(), *client, options);
    if (!cache.device_gathers()) return absl::InternalError("the stand-in does not gather");
    EngineConfig ec;
    ec.prefill_budget_tokens = prompt;
    BatchEngine engine(**model, cache, ec);
    Run r;
    r.tokens.resize(static_cast<size_t>(streams));
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
                          MakeSelectionPolicy(selection, (*model)->config(), &*sidecar, *skew));
      IG_RETURN_IF_ERROR(engine
                             .Submit(std::move(req),
                                     [&, s](const EngineEvent& e) {
                                       if (e.token >= 0) r.tokens[s].push_back(e.token);
                                       if (e.done) {
                                         status[s] = e.status;
                                         done[s].Notify();
                                       }
                                     })
                             .status());
    }
    for (auto& d : done) d.WaitForNotification();
    for (const absl::Status& st : status) IG_RETURN_IF_ERROR(st);
    const EngineStats stats = engine.Stats();
    for (const auto& t : r.tokens) r.generated += static_cast<int64_t>(t.size());
    r.fetched = stats.bytes_fetched;
    r.reused = stats.bytes_reused;
    return r;
  };

  std::printf(
      "| prompt tokens | streams | MiB moved per token, no reuse | with reuse | ratio | "
      "listed rows found kept | tokens agree |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---|\n");
  for (absl::string_view p : absl::StrSplit(prompts_list, ',')) {
    int64_t prompt = 0;
    if (!absl::SimpleAtoi(p, &prompt) || prompt <= 0 ||
        prompt >= static_cast<int64_t>(text.size())) {
      std::fprintf(stderr, "bad --prompt-tokens entry %s\n", std::string(p).c_str());
      return 2;
    }
    auto plain = run(prompt, false);
    if (!plain.ok()) return Fail(plain.status());
    auto reused = run(prompt, true);
    if (!reused.ok()) return Fail(reused.status());
    const double mib = 1 << 20;
    const double a = static_cast<double>(plain->fetched) / plain->generated / mib;
    const double b = static_cast<double>(reused->fetched) / reused->generated / mib;
    const double kept = static_cast<double>(reused->reused) /
                        static_cast<double>(std::max<int64_t>(1, reused->reused + reused->fetched));
    std::printf("| %lld | %lld | %.3f | %.3f | %.3f | %.3f | %s |\n",
                static_cast<long long>(prompt), static_cast<long long>(streams), a, b, b / a, kept,
                plain->tokens == reused->tokens ? "yes" : "NO");
    std::fflush(stdout);
  }
  return 0;
}
