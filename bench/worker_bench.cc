// Decode throughput and time per output token through a running infinigen-worker (and its KV
// store), or through the local engine in this process (BatchEngine over a resident KV cache:
// the same batching and model code without the service, the store or a transport), for the
// service-path overhead of docs/benchmarks.md. --policy applies to both: the local engine runs
// it as the worker does with its default flags (infinigen: the sidecar next to the model).
//
// usage: worker_bench (--target HOST:PORT | --local MODEL [--threads N --cpu-weights q8])
//            [--streams 1,4,16] [--prompt-tokens 128] [--new-tokens 64] [--policy full]
// Each case starts `streams` requests at once (random prompt ids, greedy, EOS ignored) and
// waits for all; tokens/s = generated tokens / wall time of the case; TPOT = the gaps between
// consecutive tokens of a stream after its first, over all streams (p50, p99). One markdown row
// per case.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "cli/loaded_model.h"
#include "gpu_worker/engine/batch_engine.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "gpu_worker/service/worker_runtime.h"
#include "infinigen/worker/v1/worker.grpc.pb.h"

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
  std::vector<double> gaps;  // seconds between consecutive tokens of a stream
  int errors = 0;
};

// Fills the totals and the token gaps of `r` from each stream's token arrival times.
void Summarize(const std::vector<std::vector<Clock::time_point>>& arrivals,
               const std::vector<int>& failed, Clock::time_point t0, CaseResult& r) {
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  for (size_t s = 0; s < arrivals.size(); ++s) {
    r.errors += failed[s];
    r.tokens += static_cast<int64_t>(arrivals[s].size());
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

}  // namespace

int main(int argc, char** argv) {
  std::string target, local, streams_list = "1,4,16", policy, label, cpu_weights = "q8";
  int64_t prompt = 128, new_tokens = 64, threads = 0;
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
    else if (k == "--prompt-tokens")
      (void)absl::SimpleAtoi(v, &prompt);
    else if (k == "--new-tokens")
      (void)absl::SimpleAtoi(v, &new_tokens);
    else if (k == "--threads")
      (void)absl::SimpleAtoi(v, &threads);
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  if (target.empty() == local.empty()) {
    std::fprintf(stderr, "give exactly one of --target HOST:PORT and --local MODEL\n");
    return 2;
  }
  std::vector<int> streams;
  for (absl::string_view s : absl::StrSplit(streams_list, ',')) {
    int n = 0;
    if (absl::SimpleAtoi(s, &n) && n > 0) streams.push_back(n);
  }
  if (label.empty()) label = target.empty() ? "local engine" : target;

  std::unique_ptr<worker::v1::Worker::Stub> stub;
  cli::LoadedModel loaded;
  std::unique_ptr<BackendKvCache> cache;
  std::unique_ptr<BatchEngine> engine;
  std::unique_ptr<InfinigenSidecar> sidecar;
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
    cli::BackendFlags flags;
    flags.threads = threads;
    flags.cpu_weights = cpu_weights;
    auto l = cli::LoadModel(local, flags);
    if (!l.ok()) {
      std::fprintf(stderr, "%s\n", std::string(l.status().message()).c_str());
      return 1;
    }
    loaded = std::move(*l);
    vocab = loaded.model->config().vocab_size;
    cache = std::make_unique<BackendKvCache>(*loaded.backend, loaded.model->kv_shape());
    // The policy as the worker would run it with its default flags and the model's sidecar.
    WorkerConfig defaults;
    defaults.policy = policy.empty() ? "full" : policy;
    if (defaults.policy == "infinigen") {
      auto s = ReadSidecar(DefaultSidecarPath(local), *loaded.checkpoint);
      if (!s.ok()) {
        std::fprintf(stderr, "%s\n", std::string(s.status().message()).c_str());
        return 1;
      }
      sidecar = std::make_unique<InfinigenSidecar>(std::move(*s));
      if (auto st = AttachSidecar(*loaded.model, *loaded.checkpoint, *sidecar); !st.ok()) {
        std::fprintf(stderr, "%s\n", std::string(st.message()).c_str());
        return 1;
      }
    }
    const SelectionConfig selection = defaults.Selection(sidecar != nullptr);
    make_policy = [&, selection]() -> absl::StatusOr<std::unique_ptr<KvSelectionPolicy>> {
      if (selection.policy == PolicyKind::kFull) return std::unique_ptr<KvSelectionPolicy>();
      return MakeSelectionPolicy(selection, loaded.model->config(), sidecar.get());
    };
    EngineConfig ec;
    ec.max_running = 64;
    engine = std::make_unique<BatchEngine>(*loaded.model, *cache, ec);
  }
  // Warm-up: one short request.
  if (stub) {
    RunRemote(*stub, 1, vocab, 16, 4, policy);
  } else {
    RunLocal(*engine, 1, vocab, 16, 4, make_policy);
  }
  for (int n : streams) {
    CaseResult r = stub ? RunRemote(*stub, n, vocab, prompt, new_tokens, policy)
                        : RunLocal(*engine, n, vocab, prompt, new_tokens, make_policy);
    std::printf("| %s | %d | %.1f | %.2f | %.2f | %d |\n", label.c_str(), n,
                static_cast<double>(r.tokens) / r.seconds, 1e3 * Percentile(r.gaps, 0.5),
                1e3 * Percentile(r.gaps, 0.99), r.errors);
    std::fflush(stdout);
  }
  return 0;
}
