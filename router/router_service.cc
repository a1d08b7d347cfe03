#include "router/router_service.h"

#include <atomic>
#include <cstdio>
#include <optional>

#include "absl/random/distributions.h"
#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/grpc/utf8_fields.h"
#include "common/status_macros.h"
#include "frontend/request_validation.h"
#include "router/pool_workers.h"
#include "router/public_status.h"
#include "router/relay.h"
#include "router/relay_driver.h"
#include "router/router_metrics.h"

namespace infinigen {
namespace {

namespace wv1 = worker::v1;
using grpc::StatusCode;

constexpr absl::Duration kUnaryTimeout = absl::Seconds(10);

wv1::GenerateRequest ToWorker(const v1::GenerateRequest& r, const RequestLimits& limits) {
  wv1::GenerateRequest w;
  w.set_request_id(r.request_id());
  switch (r.input_case()) {
    case v1::GenerateRequest::kText:
      w.set_text(r.text());
      break;
    case v1::GenerateRequest::kTokenIds:
      *w.mutable_token_ids() = r.token_ids();
      break;
    case v1::GenerateRequest::kMessages:
      *w.mutable_messages() = r.messages();
      break;
    default:
      break;
  }
  *w.mutable_sampling() = r.sampling();
  *w.mutable_stopping() = r.stopping();
  *w.mutable_selection() = r.selection();
  w.set_skip_special_tokens(r.skip_special_tokens());
  if (!r.stopping().has_max_new_tokens()) {
    w.mutable_stopping()->set_max_new_tokens(limits.DefaultMaxNewTokens());
  }
  w.set_max_prompt_tokens(limits.max_prompt_tokens);
  w.set_session_id(r.session_id());
  return w;
}

std::string NewRequestId() {
  static std::atomic<uint64_t> n{0};
  return absl::StrCat("req-", absl::ToUnixMicros(absl::Now()), "-",
                      n.fetch_add(1, std::memory_order_relaxed));
}

}  // namespace

absl::Status RouterOptions::Validate() const {
  if (max_streams < 1) return absl::InvalidArgumentError("--max_streams must be >= 1");
  if (max_queued < 0) return absl::InvalidArgumentError("--max_queued must be >= 0");
  IG_RETURN_IF_ERROR(limits.Validate());
  if (max_attempts < 1) return absl::InvalidArgumentError("--max_attempts must be >= 1");
  if (resume_wait < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--resume_wait_ms must be >= 0");
  }
  if (absl::Status st = key_limits.Validate(); !st.ok()) return st;
  return stall.Validate();
}

RouterService::RouterService(WorkerPool& pool, const RouterOptions& options)
    : pool_(pool),
      options_(options),
      admission_(options.max_streams, options.max_queued),
      watchdog_(options.stall) {
  if (options.api_keys != nullptr && options.key_limits.any()) {
    key_limits_ = std::make_unique<KeyLimits>(options.key_limits, options.api_keys->size());
  }
  // Generate and Tokenize check their requests' strings first: invalid UTF-8 is answered
  // INVALID_ARGUMENT naming the field, not INTERNAL with no message (common/grpc/utf8_fields.h).
  // The generated methods are withdrawn (marked generic: no handler) and registered again,
  // same names and types, with wrapped handlers.
  using grpc::internal::RpcMethod;
  using grpc::internal::RpcServiceMethod;
  MarkMethodGeneric(0);
  AddMethod(new RpcServiceMethod(
      "/infinigen.v1.Generation/Generate", RpcMethod::SERVER_STREAMING,
      new Utf8CheckedHandler(
          *v1::GenerateRequest::descriptor(),
          std::make_unique<grpc::internal::ServerStreamingHandler<
              v1::Generation::Service, v1::GenerateRequest, v1::GenerateResponse>>(
              [](v1::Generation::Service* service, grpc::ServerContext* context,
                 const v1::GenerateRequest* request,
                 grpc::ServerWriter<v1::GenerateResponse>* writer) {
                return service->Generate(context, request, writer);
              },
              this))));
  MarkMethodGeneric(1);
  AddMethod(new RpcServiceMethod(
      "/infinigen.v1.Generation/Tokenize", RpcMethod::NORMAL_RPC,
      new Utf8CheckedHandler(
          *v1::TokenizeRequest::descriptor(),
          std::make_unique<grpc::internal::RpcMethodHandler<
              v1::Generation::Service, v1::TokenizeRequest, v1::TokenizeResponse,
              google::protobuf::MessageLite, google::protobuf::MessageLite>>(
              [](v1::Generation::Service* service, grpc::ServerContext* context,
                 const v1::TokenizeRequest* request, v1::TokenizeResponse* response) {
                return service->Tokenize(context, request, response);
              },
              this))));
}

grpc::Status RouterService::Authenticate(const grpc::ServerContext& context, int* key) const {
  if (key != nullptr) *key = -1;
  if (options_.api_keys == nullptr) return grpc::Status::OK;
  const auto& md = context.client_metadata();
  auto it = md.find("authorization");
  const int found =
      it == md.end()
          ? -1
          : options_.api_keys->Find(absl::string_view(it->second.data(), it->second.size()));
  if (found >= 0) {
    if (key != nullptr) *key = found;
    return grpc::Status::OK;
  }
  return grpc::Status(StatusCode::UNAUTHENTICATED,
                      it == md.end() ? "send an API key: metadata `authorization: Bearer <key>`"
                                     : "the API key in `authorization: Bearer <key>` is not valid");
}

grpc::Status RouterService::Validate(const v1::GenerateRequest& r) const {
  const absl::Status st = ValidateGenerateRequest(r, options_.limits);
  return st.ok() ? grpc::Status::OK
                 : grpc::Status(StatusCode::INVALID_ARGUMENT, std::string(st.message()));
}

grpc::Status RouterService::Generate(grpc::ServerContext* context,
                                     const v1::GenerateRequest* request,
                                     grpc::ServerWriter<v1::GenerateResponse>* writer) {
  const absl::Time start = absl::Now();
  const std::string request_id =
      request->request_id().empty() || request->request_id().size() > kMaxRequestIdBytes
          ? NewRequestId()
          : request->request_id();
  RelayStats stats;
  int key = -1;
  grpc::Status s = Authenticate(*context, &key);
  if (s.ok()) s = Validate(*request);
  std::optional<KeyLimitsLease> key_lease;  // this key's share, held while the request runs
  if (s.ok() && key_limits_ != nullptr && key >= 0) {
    absl::Duration retry_after;
    const absl::Status entered =
        key_limits_->Enter(static_cast<size_t>(key), absl::Now(), &retry_after);
    if (entered.ok()) {
      key_lease.emplace(key_limits_.get(), static_cast<size_t>(key));
    } else {
      context->AddTrailingMetadata("grpc-retry-pushback-ms",
                                   absl::StrCat(absl::ToInt64Milliseconds(retry_after) + 1));
      s = grpc::Status(static_cast<StatusCode>(entered.code()), std::string(entered.message()));
    }
  }
  if (s.ok()) {
    const absl::Status admitted = admission_.Enter(absl::FromChrono(context->deadline()),
                                                   [context] { return context->IsCancelled(); });
    if (!admitted.ok()) {
      if (absl::IsResourceExhausted(admitted)) {
        context->AddTrailingMetadata("grpc-retry-pushback-ms", "100");
      }
      s = grpc::Status(static_cast<StatusCode>(admitted.code()), std::string(admitted.message()));
    } else {
      AdmissionSlot slot(&admission_);
      s = RelayStream(context, *request, request_id, writer, stats);
    }
  }
  if (metrics_ != nullptr) metrics_->RequestDone(s.error_code());
  // One line per request (never the prompt, the text or the key): its id, the outcome, what
  // was streamed. One write, so that concurrent requests' lines do not interleave.
  // The request id and the end user (OpenAI's `user`) escaped: the client chose their bytes (a
  // newline in them must not forge a line).
  const std::string user = request->user().empty()
                               ? ""
                               : absl::StrCat(" user \"", absl::CHexEscape(request->user()), "\"");
  const std::string line = absl::StrFormat(
      "request %s%s: %s%s%s, %d tokens in %.3f s, %d failovers (%d resumed from the KV store)\n",
      absl::CHexEscape(request_id), user,
      absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code())), s.ok() ? "" : ": ",
      s.error_message(), stats.tokens, absl::ToDoubleSeconds(absl::Now() - start), stats.failovers,
      stats.resumes);
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fflush(stdout);
  return ForClients(s);  // the log line above keeps the internal addresses
}

namespace {

// The public call as the relay writes to it.
class ServerClientStream final : public ClientStream {
 public:
  ServerClientStream(grpc::ServerContext& context, grpc::ServerWriter<v1::GenerateResponse>& writer)
      : context_(context), writer_(writer) {}
  bool Write(const v1::GenerateResponse& message) override { return writer_.Write(message); }
  bool Cancelled() override { return context_.IsCancelled(); }

 private:
  grpc::ServerContext& context_;
  grpc::ServerWriter<v1::GenerateResponse>& writer_;
};

}  // namespace

grpc::Status RouterService::RelayStream(grpc::ServerContext* context,
                                        const v1::GenerateRequest& request,
                                        const std::string& request_id,
                                        grpc::ServerWriter<v1::GenerateResponse>* writer,
                                        RelayStats& stats) {
  wv1::GenerateRequest wr = ToWorker(request, options_.limits);
  // A request without a seed gets its own (a fixed default would make every "random" request
  // of a prompt the same); every worker of the stream, after a failover too, uses it.
  if (!request.sampling().has_seed()) {
    thread_local absl::BitGen bits;
    wr.mutable_sampling()->set_seed(absl::Uniform<uint64_t>(bits));
  }
  wr.set_request_id(request_id);
  const int64_t budget = wr.stopping().max_new_tokens();
  RelayRules rules;
  rules.max_attempts = options_.max_attempts;
  rules.resume_wait = options_.resume_wait;
  rules.resume_from_store = options_.resume_from_store;
  Relay relay(rules, std::move(wr), budget, absl::FromChrono(context->deadline()));
  PoolWorkers workers(pool_, watchdog_, *context);
  ServerClientStream client(*context, *writer);
  const RelayAction end =
      RunRelay(relay, workers, client, request.session_id(), metrics_, request_id);
  stats.tokens = static_cast<int64_t>(relay.sent().size());
  stats.failovers = relay.failovers();
  stats.resumes = relay.resumes();
  if (end.retry_pushback_ms > 0) {
    context->AddTrailingMetadata("grpc-retry-pushback-ms", absl::StrCat(end.retry_pushback_ms));
  }
  return grpc::Status(static_cast<StatusCode>(end.status.code()),
                      std::string(end.status.message()));
}

grpc::Status RouterService::Tokenize(grpc::ServerContext* context,
                                     const v1::TokenizeRequest* request,
                                     v1::TokenizeResponse* response) {
  if (grpc::Status s = Authenticate(*context); !s.ok()) return s;
  if (static_cast<int64_t>(request->ByteSizeLong()) > options_.limits.max_request_bytes) {
    return grpc::Status(StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("the request is larger than the limit (max_request_bytes) of ",
                                     options_.limits.max_request_bytes, " bytes"));
  }
  std::vector<std::shared_ptr<PooledWorker>> tried;
  grpc::Status last(StatusCode::UNAVAILABLE, "no worker is available");
  for (int i = 0; i < options_.max_attempts; ++i) {
    std::vector<const PooledWorker*> exclude;
    for (const auto& w : tried) exclude.push_back(w.get());
    auto worker = pool_.Pick("", exclude);
    if (worker == nullptr) break;
    auto call = grpc::ClientContext::FromServerContext(*context);
    if (absl::FromChrono(context->deadline()) > absl::Now() + kUnaryTimeout) {
      call->set_deadline(absl::ToChronoTime(absl::Now() + kUnaryTimeout));
    }
    last = worker->stub().Tokenize(call.get(), *request, response);
    if (last.ok() || !RetriableOnAnotherWorker(static_cast<absl::StatusCode>(last.error_code()))) {
      return ForClients(last);
    }
    tried.push_back(worker);
  }
  std::fprintf(stderr, "tokenize: no worker could serve it: %s\n", last.error_message().c_str());
  return ForClients(grpc::Status(StatusCode::UNAVAILABLE,
                                 absl::StrCat("no worker could tokenize: ", last.error_message())));
}

grpc::Status RouterService::GetModelInfo(grpc::ServerContext* context,
                                         const v1::GetModelInfoRequest*, v1::ModelInfo* info) {
  if (grpc::Status s = Authenticate(*context); !s.ok()) return s;
  // From the pool's state (what each worker said when it turned SERVING): a frozen worker
  // cannot make this call wait.
  std::shared_ptr<const wv1::InfoResponse> known;
  for (const auto& worker : pool_.Workers()) {
    if (!worker->available()) continue;
    known = worker->info();
    if (known != nullptr) break;
  }
  if (known == nullptr) {
    return grpc::Status(StatusCode::UNAVAILABLE,
                        "no worker is available (none has answered the router's health checks)");
  }
  const wv1::InfoResponse& w = *known;
  info->set_model(w.model());
  info->set_architecture(w.architecture());
  info->set_num_layers(w.num_layers());
  info->set_num_heads(w.num_heads());
  info->set_num_kv_heads(w.num_kv_heads());
  info->set_head_dim(w.head_dim());
  info->set_vocab_size(w.vocab_size());
  info->set_max_context_tokens(w.max_context_tokens());
  info->set_max_new_tokens_limit(
      std::min(w.max_new_tokens_limit(), options_.limits.max_new_tokens_limit));
  info->set_max_prompt_tokens(
      options_.limits.max_prompt_tokens > 0
          ? std::min(w.max_context_tokens(), options_.limits.max_prompt_tokens)
          : w.max_context_tokens());
  info->set_max_request_bytes(options_.limits.max_request_bytes);
  info->set_default_policy(w.default_policy());
  info->set_backend(w.backend());
  *info->mutable_policies() = w.policies();
  info->set_workers(pool_.available());
  info->set_streams(admission_.streams());
  info->set_queued(admission_.queued());
  return grpc::Status::OK;
}

}  // namespace infinigen
