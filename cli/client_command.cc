// infinigen client: generates through a server's public API (infinigen-router or
// `infinigen serve`) and streams the text to stdout as it arrives; usage and timings go to
// stderr. --info prints the model and limits instead, --tokenize the prompt's tokens;
// --logprobs N prints each generated token's id, logprob and N alternatives as a JSON line.
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/sampling_flags.h"
#include "cli/server_connection.h"
#include "common/grpc/status.h"
#include "infinigen/v1/generation.grpc.pb.h"

namespace infinigen::cli {
namespace {

int Fail(const grpc::Status& s) { return ReportError("client", FromGrpcStatus(s)); }

}  // namespace

int RunClient(int argc, char** argv) {
  ConnectionFlags connection;
  std::string prompt, chat, prompt_ids, stop, session, policy;
  SamplingFlags sampling;
  int64_t timeout_s = 600;
  double budget = 0.0;
  bool print_ids = false, info = false, tokenize = false;
  int64_t logprobs = -1;
  FlagSet flags("infinigen client",
                "[--server HOST:PORT] (--prompt TEXT | --chat JSON | --prompt-ids 1,2,3)",
                "Generates through a server's public API and streams the text to stdout "
                "(token ids with --ids); usage and timings go to stderr.");
  connection.Register(flags);
  flags.String("prompt", &prompt, "prompt text (BOS added as the tokenizer says)");
  flags.String("chat", &chat,
               "conversation as JSON: [{\"role\": \"user\", \"content\": \"...\"}, ...]");
  flags.String("prompt-ids", &prompt_ids, "prompt as comma-separated token ids");
  sampling.Register(flags);
  flags.String("stop", &stop, "stop string: generation ends before it");
  flags.String("session", &session, "session id: requests of a session go to the same worker");
  flags.String("policy", &policy, "KV selection for this request: full, infinigen, window");
  flags.Float("budget", &budget, "fraction of stored rows a decode step may read (0: default)");
  flags.Int("timeout", &timeout_s, "deadline of the request, in seconds");
  flags.Bool("ids", &print_ids, "print the generated token ids as a JSON array, not text");
  flags.Int("logprobs", &logprobs,
            "print each generated token as a JSON line {\"id\", \"logprob\", \"top\": [[id, "
            "logprob], ...]} with this many alternatives (0-20; -1: text)");
  flags.Bool("info", &info, "print the served model and the server's limits");
  flags.Bool("tokenize", &tokenize, "print the prompt's token ids and pieces");
  auto parsed = flags.Parse(argc, argv);
  if (!parsed.ok()) return ReportError("client", parsed.status());
  if (!*parsed) return 0;

  // Checked here as the local engine checks them; the server checks them again.
  auto options = sampling.Options();
  if (!options.ok()) return ReportError("client", options.status());
  auto channel = connection.Connect();
  if (!channel.ok()) return ReportError("client", channel.status());
  auto stub = v1::Generation::NewStub(*channel);
  auto deadline = absl::ToChronoTime(absl::Now() + absl::Seconds(timeout_s));

  if (info) {
    grpc::ClientContext ctx;
    ctx.set_deadline(deadline);
    connection.Authorize(ctx);
    v1::ModelInfo m;
    if (auto s = stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &m); !s.ok()) return Fail(s);
    std::cout << m.DebugString();
    return 0;
  }

  v1::GenerateRequest r;
  if ((!prompt.empty()) + (!chat.empty()) + (!prompt_ids.empty()) != 1) {
    return ReportError("client", absl::InvalidArgumentError(
                                     "give exactly one of --prompt, --chat and --prompt-ids"));
  }
  if (!prompt.empty()) r.set_text(prompt);
  if (!prompt_ids.empty()) {
    auto ids = ParseIdList(prompt_ids, "prompt-ids");
    if (!ids.ok()) return ReportError("client", ids.status());
    for (int32_t id : *ids) r.mutable_token_ids()->add_ids(id);
  }
  if (!chat.empty()) {
    auto messages = ParseChatFlag(chat);
    if (!messages.ok()) return ReportError("client", messages.status());
    for (const auto& [role, content] : *messages) {
      auto* m = r.mutable_messages()->add_messages();
      m->set_role(role);
      m->set_content(content);
    }
  }

  if (tokenize) {
    v1::TokenizeRequest t;
    if (r.has_token_ids()) *t.mutable_token_ids() = r.token_ids();
    if (r.has_messages()) *t.mutable_messages() = r.messages();
    if (!prompt.empty()) {
      t.set_text(prompt);
      t.set_add_special(true);
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(deadline);
    connection.Authorize(ctx);
    v1::TokenizeResponse out;
    if (auto s = stub->Tokenize(&ctx, t, &out); !s.ok()) return Fail(s);
    std::cout << out.DebugString();
    return 0;
  }

  auto* s = r.mutable_sampling();
  s->set_temperature(options->sampling.temperature);
  s->set_top_k(options->sampling.top_k);
  s->set_top_p(options->sampling.top_p);
  s->set_min_p(options->sampling.min_p);
  s->set_repetition_penalty(options->sampling.repetition_penalty);
  s->set_presence_penalty(options->sampling.presence_penalty);
  s->set_frequency_penalty(options->sampling.frequency_penalty);
  if (options->sampling.seed != 0) s->set_seed(options->sampling.seed);  // 0: the server draws
  r.mutable_stopping()->set_max_new_tokens(static_cast<int32_t>(options->max_new_tokens));
  r.mutable_stopping()->set_ignore_eos(options->ignore_eos);
  if (!stop.empty()) r.mutable_stopping()->add_stop_strings(stop);
  r.set_session_id(session);
  if (!policy.empty()) r.mutable_selection()->set_policy(policy);
  if (budget > 0) r.mutable_selection()->set_budget_fraction(budget);
  if (logprobs >= 0) s->set_logprobs(static_cast<int32_t>(logprobs));  // the server checks it

  grpc::ClientContext ctx;
  ctx.set_deadline(deadline);
  connection.Authorize(ctx);
  auto reader = stub->Generate(&ctx, r);
  v1::GenerateResponse m, last;
  std::vector<int32_t> ids;
  while (reader->Read(&m)) {
    ids.insert(ids.end(), m.token_ids().begin(), m.token_ids().end());
    if (logprobs >= 0) {
      for (int i = 0; i < m.logprobs_size() && i < m.token_ids_size(); ++i) {
        const v1::Logprobs& l = m.logprobs(i);
        std::vector<std::string> top;
        for (const v1::TokenLogprob& t : l.top()) {
          top.push_back(absl::StrFormat("[%d, %.9g]", t.token_id(), t.logprob()));
        }
        std::cout << absl::StrFormat("{\"id\": %d, \"logprob\": %.9g, \"top\": [%s]}\n",
                                     m.token_ids(i), l.logprob(), absl::StrJoin(top, ", "));
      }
    } else if (!print_ids) {
      std::cout << m.text() << std::flush;
    }
    if (m.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) last = m;
  }
  grpc::Status status = reader->Finish();
  if (print_ids) {
    std::cout << "[" << absl::StrJoin(ids, ", ") << "]";
  }
  std::cout << std::endl;
  if (!status.ok()) return Fail(status);
  const auto& u = last.usage();
  const auto& t = last.timings();
  std::cerr << absl::StrFormat(
      "[%d prompt (%lld cached) + %d generated tokens, finish %s, time to first token %.3f s, "
      "%.1f ms/token, failovers %d (%d resumed), seed %llu]\n[policy %s on %s: KV fetched %.2f "
      "MiB, %.1f%% of a full fetch (%.2f MiB)]\n",
      u.prompt_tokens(), static_cast<long long>(u.cached_tokens()), u.generated_tokens(),
      v1::FinishReason_Name(last.finish_reason()), t.time_to_first_token_seconds(),
      1e3 * t.time_per_output_token_seconds(), last.failovers(), last.resumes(),
      static_cast<unsigned long long>(last.seed()), u.policy().empty() ? "?" : u.policy(),
      u.backend().empty() ? "?" : u.backend(),
      static_cast<double>(u.kv_bytes_fetched()) / (1 << 20), 100.0 * u.selection_fraction(),
      static_cast<double>(u.kv_bytes_full_fetch()) / (1 << 20));
  return 0;
}

}  // namespace infinigen::cli
