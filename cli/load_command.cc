// infinigen load: a bounded load generator. N concurrent streams each send Generate requests
// back to back for T seconds (requests under way at the end finish), then it reports requests/s,
// tokens/s, time to first token and time between tokens (p50/p99, as the client sees them) and
// errors by status code. --api worker drives a worker's own API, to compare against the router;
// --api openai the OpenAI-compatible HTTP front door (--server is then its host:port), streamed
// completions, to compare HTTP against gRPC. With the mix flags, some requests are cancelled,
// run out of time or are malformed on purpose; their failures are counted apart from errors
// (the soak, scripts/soak.sh).
#include <algorithm>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/load_samples.h"
#include "cli/openai_load.h"
#include "cli/server_connection.h"
#include "infinigen/v1/generation.grpc.pb.h"
#include "infinigen/worker/v1/worker.grpc.pb.h"
#include "nlohmann/json.hpp"

namespace infinigen::cli {
namespace {

double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0.0;
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(i), v.end());
  return v[i];
}

// What a request of the mix is, and the failure it is meant to end with.
enum class Kind { kNormal, kCancelled, kDeadline, kMalformed };

Kind PickKind(const LoadSpec& spec, std::mt19937_64& rng) {
  const double u = std::uniform_real_distribution<double>(0, 1)(rng);
  if (u < spec.cancel_fraction) return Kind::kCancelled;
  if (u < spec.cancel_fraction + spec.deadline_fraction) return Kind::kDeadline;
  if (u < spec.cancel_fraction + spec.deadline_fraction + spec.malformed_fraction) {
    return Kind::kMalformed;
  }
  return Kind::kNormal;
}

// One stream: requests back to back until spec.end. Works for both APIs' request types.
template <typename Stub, typename Request, typename Response>
void Drive(Stub& stub, const ConnectionFlags& connection, const LoadSpec& spec, int stream,
           Samples& out) {
  std::mt19937_64 rng(static_cast<uint64_t>(stream) * 7919 + 1);
  std::vector<double> ttft, gaps;
  int64_t ok = 0, tokens = 0;
  std::map<std::string, int64_t> errors, expected;
  while (absl::Now() < spec.end) {
    const Kind kind = PickKind(spec, rng);
    Request r;
    if (!spec.text.empty()) {
      r.set_text(spec.text);
    } else {
      for (int64_t i = 0; i < spec.prompt_tokens; ++i) {
        r.mutable_token_ids()->add_ids(static_cast<int32_t>(1 + rng() % (spec.vocab - 1)));
      }
    }
    if (kind == Kind::kMalformed) {  // one id outside the vocabulary
      r.clear_text();
      r.mutable_token_ids()->add_ids(static_cast<int32_t>(spec.vocab + 1 + rng() % 1000));
    }
    r.mutable_sampling()->set_temperature(static_cast<float>(spec.temperature));
    r.mutable_sampling()->set_seed(rng());
    r.mutable_stopping()->set_max_new_tokens(static_cast<int32_t>(spec.max_tokens));
    r.mutable_stopping()->set_ignore_eos(true);
    grpc::ClientContext ctx;
    absl::Time deadline = spec.end + absl::Seconds(spec.timeout_seconds);
    if (kind == Kind::kDeadline) {  // 10-200 ms: shorter than most generations
      deadline = absl::Now() + absl::Milliseconds(10 + static_cast<int64_t>(rng() % 190));
    }
    ctx.set_deadline(absl::ToChronoTime(deadline));
    connection.Authorize(ctx);
    const int64_t cancel_after =
        kind == Kind::kCancelled ? 1 + static_cast<int64_t>(rng() % spec.max_tokens) : -1;
    const absl::Time start = absl::Now();
    absl::Time prev = start;
    bool first = true;
    auto reader = stub.Generate(&ctx, r);
    Response m;
    int64_t n = 0;
    while (reader->Read(&m)) {
      if (m.token_ids_size() == 0) continue;
      const absl::Time now = absl::Now();
      (first ? ttft : gaps).push_back(absl::ToDoubleSeconds(now - prev));
      first = false;
      prev = now;
      n += m.token_ids_size();
      if (cancel_after > 0 && n >= cancel_after) ctx.TryCancel();
    }
    const grpc::Status s = reader->Finish();
    static constexpr grpc::StatusCode kMeant[] = {grpc::StatusCode::OK, grpc::StatusCode::CANCELLED,
                                                  grpc::StatusCode::DEADLINE_EXCEEDED,
                                                  grpc::StatusCode::INVALID_ARGUMENT};
    static constexpr const char* kName[] = {"normal", "cancelled", "deadline", "malformed"};
    const int k = static_cast<int>(kind);
    if (s.ok() && kind != Kind::kMalformed) {  // a cancel or deadline may come too late
      ++ok;
      tokens += n;
    } else if (kind != Kind::kNormal && s.error_code() == kMeant[k]) {
      ++expected[absl::StrCat(kName[k], " ", s.error_code())];
    } else {
      ++errors[absl::StrCat(kind == Kind::kNormal ? "" : absl::StrCat(kName[k], " request: "),
                            s.error_code(), " ", s.error_message().substr(0, 80))];
    }
  }
  out.Merge(ok, tokens, errors, ttft, gaps, expected);
}

struct Finished {
  std::unique_ptr<Samples> samples = std::make_unique<Samples>();
  double elapsed = 0;
};

// Runs `streams` threads of drive(i, samples) from now for `seconds` (spec.end is set).
template <typename DriveFn>
Finished RunStreams(int64_t streams, double seconds, LoadSpec& spec, const DriveFn& drive) {
  Finished f;
  const absl::Time start = absl::Now();
  spec.end = start + absl::Seconds(seconds);
  std::vector<std::thread> threads;
  for (int i = 0; i < streams; ++i) threads.emplace_back([&, i] { drive(i, *f.samples); });
  for (auto& t : threads) t.join();
  f.elapsed = absl::ToDoubleSeconds(absl::Now() - start);
  return f;
}

// Prints (and writes to json_path) what the streams measured; the exit code.
int Report(Finished f, int64_t streams, const std::string& json_path, int64_t max_errors) {
  Samples& samples = *f.samples;
  const double elapsed = f.elapsed;
  int64_t errors = 0;
  for (const auto& [k, v] : samples.errors) errors += v;

  nlohmann::json j;
  j["streams"] = streams;
  j["seconds"] = elapsed;
  j["requests_ok"] = samples.ok;
  j["errors"] = errors;
  j["tokens"] = samples.tokens;
  j["requests_per_second"] = static_cast<double>(samples.ok) / elapsed;
  j["tokens_per_second"] = static_cast<double>(samples.tokens) / elapsed;
  j["ttft_p50_ms"] = 1e3 * Percentile(samples.ttft, 0.50);
  j["ttft_p99_ms"] = 1e3 * Percentile(samples.ttft, 0.99);
  j["token_gap_p50_ms"] = 1e3 * Percentile(samples.gaps, 0.50);
  j["token_gap_p99_ms"] = 1e3 * Percentile(samples.gaps, 0.99);
  // The longest wait for a next token: a failover's cost (kill to the next token's arrival).
  j["token_gap_max_ms"] = samples.gaps.empty()
                              ? 0.0
                              : 1e3 * *std::max_element(samples.gaps.begin(), samples.gaps.end());
  for (const auto& [k, v] : samples.errors) j["error_codes"][k] = v;
  for (const auto& [k, v] : samples.expected) j["expected_failures"][k] = v;
  std::cout << absl::StrFormat(
      "load: %d streams, %.1f s: %d requests ok (%.2f/s), %d tokens (%.1f/s), %d errors\n"
      "  time to first token p50 %.2f ms, p99 %.2f ms; between tokens p50 %.2f ms, p99 %.2f ms\n",
      streams, elapsed, samples.ok, j["requests_per_second"].get<double>(), samples.tokens,
      j["tokens_per_second"].get<double>(), errors, j["ttft_p50_ms"].get<double>(),
      j["ttft_p99_ms"].get<double>(), j["token_gap_p50_ms"].get<double>(),
      j["token_gap_p99_ms"].get<double>());
  for (const auto& [k, v] : samples.errors) std::cout << "  error " << k << ": " << v << "\n";
  for (const auto& [k, v] : samples.expected) {
    std::cout << "  expected failure (the mix) " << k << ": " << v << "\n";
  }
  if (!json_path.empty()) std::ofstream(json_path) << j.dump(2) << "\n";
  return max_errors >= 0 && errors > max_errors ? 1 : 0;
}

}  // namespace

int RunLoad(int argc, char** argv) {
  ConnectionFlags connection;
  LoadSpec spec;
  int64_t streams = 16, max_errors = -1;
  double seconds = 20;
  std::string api = "public", json_path;
  FlagSet flags("infinigen load", "[--server HOST:PORT] --streams N --seconds T",
                "Drives N concurrent streams of Generate requests for T seconds and reports "
                "requests/s, tokens/s, time to first token, time between tokens and errors.");
  connection.Register(flags);
  flags.Int("streams", &streams, "concurrent streams");
  flags.Float("seconds", &seconds, "how long new requests are started");
  flags.Int("prompt-tokens", &spec.prompt_tokens, "random prompt tokens per request");
  flags.String("text", &spec.text, "send this prompt text instead of random token ids");
  flags.Int("max-tokens", &spec.max_tokens, "tokens generated per request (EOS ignored)");
  flags.Float("temperature", &spec.temperature, "sampling temperature (0 = greedy)");
  flags.Float("timeout", &spec.timeout_seconds,
              "seconds after the end that a request may still run (its deadline)");
  flags.String("api", &api,
               "public (router, serve), worker (a worker directly) or openai (the HTTP front "
               "door at --server)");
  flags.String("json", &json_path, "also write the results as JSON to this file");
  flags.Int("max-errors", &max_errors,
            "exit 1 when more requests than this fail unexpectedly (-1: never)");
  flags.Float("cancel-fraction", &spec.cancel_fraction,
              "fraction of requests cancelled by the client after a few tokens");
  flags.Float("deadline-fraction", &spec.deadline_fraction,
              "fraction of requests with a 10-200 ms deadline (DEADLINE_EXCEEDED expected)");
  flags.Float("malformed-fraction", &spec.malformed_fraction,
              "fraction of requests with a token id outside the vocabulary (INVALID_ARGUMENT "
              "expected)");
  auto parsed = flags.Parse(argc, argv);
  if (!parsed.ok()) return ReportError("load", parsed.status());
  if (!*parsed) return 0;
  if (streams < 1 || seconds <= 0 || spec.max_tokens < 1 || spec.prompt_tokens < 1) {
    return ReportError("load", absl::InvalidArgumentError(
                                   "--streams, --seconds, --max-tokens and --prompt-tokens must "
                                   "be positive"));
  }
  const double mix = spec.cancel_fraction + spec.deadline_fraction + spec.malformed_fraction;
  if (spec.cancel_fraction < 0 || spec.deadline_fraction < 0 || spec.malformed_fraction < 0 ||
      mix > 1) {
    return ReportError("load", absl::InvalidArgumentError(
                                   "--cancel-fraction, --deadline-fraction and "
                                   "--malformed-fraction must be >= 0 and sum to at most 1"));
  }
  if (mix > 0 && api == "openai") {
    return ReportError(
        "load", absl::InvalidArgumentError("the mix (--*-fraction) drives the gRPC APIs only"));
  }
  if (api != "public" && api != "worker" && api != "openai") {
    return ReportError("load",
                       absl::InvalidArgumentError("--api must be public, worker or openai"));
  }
  if (api == "openai") {
    if (spec.text.empty() && spec.vocab <= 0) {
      spec.vocab = 32;  // random ids below any vocabulary's size: HTTP has no model info here
    }
    return Report(RunStreams(streams, seconds, spec,
                             [&](int i, Samples& samples) {
                               DriveOpenAi(connection.server, connection.api_key, spec, i, samples);
                             }),
                  streams, json_path, max_errors);
  }
  auto channel = connection.Connect();
  if (!channel.ok()) return ReportError("load", channel.status());
  auto pub = v1::Generation::NewStub(*channel);
  auto wrk = worker::v1::Worker::NewStub(*channel);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    connection.Authorize(ctx);
    grpc::Status s;
    if (api == "public") {
      v1::ModelInfo m;
      s = pub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &m);
      spec.vocab = m.vocab_size();
    } else {
      worker::v1::InfoResponse m;
      s = wrk->Info(&ctx, worker::v1::InfoRequest(), &m);
      spec.vocab = m.vocab_size();
    }
    if (!s.ok()) {
      return ReportError("load", absl::UnavailableError("model info: " + s.error_message()));
    }
  }

  return Report(
      RunStreams(streams, seconds, spec,
                 [&](int i, Samples& samples) {
                   if (api == "public") {
                     Drive<v1::Generation::Stub, v1::GenerateRequest, v1::GenerateResponse>(
                         *pub, connection, spec, i, samples);
                   } else {
                     Drive<worker::v1::Worker::Stub, worker::v1::GenerateRequest,
                           worker::v1::GenerateResponse>(*wrk, connection, spec, i, samples);
                   }
                 }),
      streams, json_path, max_errors);
}

}  // namespace infinigen::cli