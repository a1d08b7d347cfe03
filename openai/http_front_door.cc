#include "openai/http_front_door.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cmath>
#include <ctime>
#include <functional>
#include <optional>
#include <random>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "infinigen/v1/generation.grpc.pb.h"
#include "openai/generate_calls.h"
#include "openai/http_server.h"
#include "openai/request_json.h"
#include "openai/response_json.h"

namespace infinigen::openai {
namespace {

namespace http = boost::beast::http;

// The HTTP status of a gRPC failure, as OpenAI's clients read them (they retry 429 and 5xx).
ApiError FromGrpc(const grpc::Status& st, const grpc::ClientContext& ctx) {
  ApiError e;
  e.message = st.error_message();
  switch (st.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::OUT_OF_RANGE:
    case grpc::StatusCode::FAILED_PRECONDITION:
      e.http_status = 400;
      break;
    case grpc::StatusCode::UNAUTHENTICATED:
      e.http_status = 401;
      e.type = "authentication_error";
      e.code = "invalid_api_key";
      break;
    case grpc::StatusCode::PERMISSION_DENIED:
      e.http_status = 403;
      e.type = "permission_error";
      break;
    case grpc::StatusCode::NOT_FOUND:
      e.http_status = 404;
      e.type = "not_found_error";
      break;
    case grpc::StatusCode::RESOURCE_EXHAUSTED: {
      e.http_status = 429;
      e.type = "rate_limit_error";
      e.retry_after_seconds = 1;
      const auto& md = ctx.GetServerTrailingMetadata();
      if (auto it = md.find("grpc-retry-pushback-ms"); it != md.end()) {
        int64_t ms = 0;
        if (absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()), &ms)) {
          e.retry_after_seconds = static_cast<int>(std::max<int64_t>(1, (ms + 999) / 1000));
        }
      }
      break;
    }
    case grpc::StatusCode::UNAVAILABLE:
      e.http_status = 503;
      e.type = "service_unavailable";
      e.retry_after_seconds = 1;
      break;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      e.http_status = 504;
      e.type = "timeout";
      break;
    case grpc::StatusCode::UNIMPLEMENTED:
      e.http_status = 501;
      break;
    default:
      e.http_status = 500;
      e.type = "server_error";
  }
  return e;
}

std::string RandomHex(int bytes) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  std::string out;
  for (int i = 0; i < bytes; ++i) absl::StrAppend(&out, absl::Hex(rng() & 0xff, absl::kZeroPad2));
  return out;
}

// Cancels `ctx` when the client hangs up (the connection's read side closes) while a
// generation runs, watched by poll() on its own thread; ending the watch wakes it at once (an
// eventfd), so the connection's next request does not wait for it.
class HangupWatch {
 public:
  HangupWatch(int fd, std::function<void()> cancel) : wake_(::eventfd(0, EFD_CLOEXEC)) {
    thread_ = std::thread([this, fd, cancel = std::move(cancel)] {
      pollfd p[2] = {{fd, POLLRDHUP, 0}, {wake_, POLLIN, 0}};
      while (!stop_.load()) {
        const int n = ::poll(p, wake_ >= 0 ? 2 : 1, 50);
        if (n > 0 && (p[0].revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
          gone_.store(true);
          cancel();
          return;
        }
      }
    });
  }
  ~HangupWatch() {
    stop_.store(true);
    if (wake_ >= 0) {
      const uint64_t one = 1;
      (void)!::write(wake_, &one, sizeof(one));
    }
    thread_.join();
    if (wake_ >= 0) ::close(wake_);
  }
  bool gone() const { return gone_.load(); }

 private:
  const int wake_;
  std::atomic<bool> stop_{false}, gone_{false};
  std::thread thread_;
};

// Cancels a request's calls from another thread (the hangup watch, the server shutting down),
// whether they have started yet or not: once attached, they are cancelled at once if it came
// before.
class CallsCancel {
 public:
  void operator()() {
    absl::MutexLock l(&mu_);
    cancelled_ = true;
    if (calls_ != nullptr) calls_->CancelAll();
  }
  // `calls` (null: none any more, before they are destroyed).
  void Attach(GenerateCalls* calls) {
    absl::MutexLock l(&mu_);
    calls_ = calls;
    if (cancelled_ && calls_ != nullptr) calls_->CancelAll();
  }
  bool cancelled() const {
    absl::MutexLock l(&mu_);
    return cancelled_;
  }

 private:
  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  GenerateCalls* calls_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace

class HttpFrontDoor::Impl {
 public:
  Impl(const HttpFrontDoorConfig& config, std::shared_ptr<grpc::Channel> channel)
      : config_(config),
        stub_(v1::Generation::NewStub(channel)),
        health_(grpc::health::v1::Health::NewStub(channel)),
        started_(static_cast<int64_t>(std::time(nullptr))) {}

  absl::Status Start() {
    IG_ASSIGN_OR_RETURN(
        server_, HttpServer::Start(config_, [this](const HttpRequest& req, HttpConnection& conn) {
          return Handle(req, conn);
        }));
    return absl::OkStatus();
  }

  int port() const { return server_->port(); }
  void Shutdown() {
    if (server_ != nullptr) server_->Shutdown();
  }

 private:
  // Answers one request; false when the connection must close.
  bool Handle(const HttpRequest& req, HttpConnection& conn) {
    std::string path(req.target());
    if (const size_t q = path.find('?'); q != std::string::npos) path.resize(q);
    const bool keep = req.keep_alive();
    auto method = [&](http::verb want) {
      if (req.method() == want) return true;
      WriteError(conn, req.version(),
                 {405, absl::StrCat(path, " takes ", std::string(http::to_string(want)))}, keep);
      return false;
    };
    if (path == "/health") return !method(http::verb::get) ? keep : Health(req, conn);
    if (path == "/v1/models") return !method(http::verb::get) ? keep : Models(req, conn);
    if (path == "/v1/completions") {
      return !method(http::verb::post) ? keep : Generate(Endpoint::kCompletions, req, conn);
    }
    if (path == "/v1/chat/completions") {
      return !method(http::verb::post) ? keep : Generate(Endpoint::kChatCompletions, req, conn);
    }
    if (path == "/tokenize" || path == "/detokenize") {
      return !method(http::verb::post) ? keep : Tokenize(path == "/detokenize", req, conn);
    }
    ApiError e{404,
               absl::StrCat("no route ", path,
                            "; this server has /v1/completions, /v1/chat/completions, "
                            "/v1/models, /tokenize, /detokenize and /health"),
               "not_found_error"};
    return WriteError(conn, req.version(), e, keep);
  }

  static void Authorize(const HttpRequest& req, grpc::ClientContext& ctx) {
    auto it = req.find(http::field::authorization);
    if (it != req.end()) ctx.AddMetadata("authorization", std::string(it->value()));
  }

  bool Health(const HttpRequest& req, HttpConnection& conn) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    grpc::health::v1::HealthCheckRequest check;
    check.set_service(v1::Generation::service_full_name());
    grpc::health::v1::HealthCheckResponse answer;
    const grpc::Status st = health_->Check(&ctx, check, &answer);
    const bool serving =
        st.ok() && answer.status() == grpc::health::v1::HealthCheckResponse::SERVING;
    return WriteJson(conn, req.version(), serving ? 200 : 503,
                     serving ? R"({"status":"ok"})" : R"({"status":"unavailable"})",
                     req.keep_alive(), serving ? 0 : 1);
  }

  // The served model's name and context (cached after the first answer).
  grpc::Status Info(const HttpRequest& req, v1::ModelInfo& out) {
    {
      absl::MutexLock l(&mu_);
      if (info_.has_value()) {
        out = *info_;
        return grpc::Status::OK;
      }
    }
    grpc::ClientContext ctx;
    Authorize(req, ctx);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    const grpc::Status st = stub_->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &out);
    if (st.ok()) {
      absl::MutexLock l(&mu_);
      info_ = out;
    }
    return st;
  }

  bool Models(const HttpRequest& req, HttpConnection& conn) {
    v1::ModelInfo info;
    grpc::ClientContext ctx;  // only for FromGrpc's metadata
    const grpc::Status st = Info(req, info);
    if (!st.ok()) return WriteError(conn, req.version(), FromGrpc(st, ctx), req.keep_alive());
    const nlohmann::json body = {{"object", "list"},
                                 {"data",
                                  {{{"id", info.model()},
                                    {"object", "model"},
                                    {"created", started_},
                                    {"owned_by", "infinigen"},
                                    {"max_model_len", info.max_context_tokens()}}}}};
    // A checkpoint's name may hold any bytes: invalid UTF-8 becomes U+FFFD, never an exception.
    return WriteJson(conn, req.version(), 200,
                     body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
                     req.keep_alive());
  }

  // 404 for a request that names another model than the served one.
  static ApiError UnknownModel(const std::string& asked, const std::string& served) {
    return {404,
            absl::StrCat("the model '", asked, "' does not exist here; this server serves '",
                         served, "' (GET /v1/models)"),
            "invalid_request_error", "model", "model_not_found"};
  }

  // vLLM's /tokenize and /detokenize: the gRPC API's Tokenize.
  bool Tokenize(bool detokenize, const HttpRequest& req, HttpConnection& conn) {
    const bool keep = req.keep_alive();
    TokenizeCall call;
    ApiError error;
    if (!ParseTokenizeRequest(req.body(), detokenize, call, error)) {
      return WriteError(conn, req.version(), error, keep);
    }
    v1::ModelInfo info;
    grpc::ClientContext info_ctx;  // only for FromGrpc's metadata
    if (const grpc::Status st = Info(req, info); !st.ok()) {
      return WriteError(conn, req.version(), FromGrpc(st, info_ctx), keep);
    }
    if (!call.model.empty() && call.model != info.model()) {
      return WriteError(conn, req.version(), UnknownModel(call.model, info.model()), keep);
    }
    grpc::ClientContext ctx;
    Authorize(req, ctx);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::TokenizeResponse answer;
    if (const grpc::Status st = stub_->Tokenize(&ctx, call.request, &answer); !st.ok()) {
      return WriteError(conn, req.version(), FromGrpc(st, ctx), keep);
    }
    return WriteJson(conn, req.version(), 200,
                     detokenize ? DetokenizeJson(answer)
                                : TokenizeJson(answer, info.max_context_tokens(), call.token_strs),
                     keep);
  }

  // A token's text (the model's decoding of that id alone), for logprobs.
  std::string TokenText(const HttpRequest& req, int32_t id) {
    {
      absl::MutexLock l(&mu_);
      if (auto it = token_texts_.find(id); it != token_texts_.end()) return it->second;
    }
    grpc::ClientContext ctx;
    Authorize(req, ctx);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::TokenizeRequest tr;
    tr.mutable_token_ids()->add_ids(id);
    v1::TokenizeResponse answer;
    if (!stub_->Tokenize(&ctx, tr, &answer).ok()) return absl::StrCat("<", id, ">");
    absl::MutexLock l(&mu_);
    if (token_texts_.size() > 200000) token_texts_.clear();  // bounded (a vocabulary's worth)
    token_texts_[id] = answer.text();
    return answer.text();
  }

  // Completions' echo of prompt `p`: its text (the prompt string, or the decoding of its ids)
  // and its tokens' texts, from the worker's tokenizer; the error to answer when there is none.
  std::optional<ApiError> Echo(const HttpRequest& req, const ParsedRequest& parsed, int p,
                               ResponseBuilder& builder) {
    const v1::GenerateRequest g = parsed.Request(p);
    if (g.has_text() && parsed.top_logprobs < 0) {  // the prompt string is all it needs
      builder.Echo(g.text(), {}, parsed.prompt_logprobs >= 0, parsed.prompt_only, p);
      return std::nullopt;
    }
    v1::TokenizeRequest tr;
    if (g.has_token_ids()) {
      *tr.mutable_token_ids() = g.token_ids();
    } else {
      tr.set_text(g.text());
      tr.set_add_special(true);  // as Generate encodes a text prompt
    }
    grpc::ClientContext ctx;
    Authorize(req, ctx);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::TokenizeResponse answer;
    if (const grpc::Status st = stub_->Tokenize(&ctx, tr, &answer); !st.ok()) {
      return FromGrpc(st, ctx);
    }
    builder.Echo(g.has_token_ids() ? answer.text() : g.text(),
                 {answer.pieces().begin(), answer.pieces().end()}, parsed.prompt_logprobs >= 0,
                 parsed.prompt_only, p);
    return std::nullopt;
  }

  bool Generate(Endpoint endpoint, const HttpRequest& req, HttpConnection& conn) {
    const bool keep = req.keep_alive();
    ParsedRequest parsed;
    ApiError error;
    if (!ParseRequest(endpoint, req.body(), parsed, error)) {
      return WriteError(conn, req.version(), error, keep);
    }
    v1::ModelInfo info;
    if (Info(req, info).ok() && !parsed.model.empty() && parsed.model != info.model()) {
      return WriteError(conn, req.version(), UnknownModel(parsed.model, info.model()), keep);
    }
    const std::string model = info.model().empty() ? parsed.model : info.model();
    const std::string id =
        absl::StrCat(endpoint == Endpoint::kChatCompletions ? "chatcmpl-" : "cmpl-", RandomHex(12));
    const int n = parsed.n, prompts = parsed.prompts();
    ResponseBuilder builder(
        endpoint, id, static_cast<int64_t>(std::time(nullptr)), model, parsed.top_logprobs,
        [this, &req](int32_t token) { return TokenText(req, token); }, n, prompts);
    // A hangup (or the server shutting down) cancels the calls, also while the prompts' echo
    // is tokenized before them.
    CallsCancel cancel;
    conn.OnShutdown([&cancel] { cancel(); });
    absl::Cleanup forget = [&conn] { conn.OnShutdown(nullptr); };
    HangupWatch watch(conn.fd(), [&cancel] { cancel(); });
    if (parsed.echo) {
      for (int p = 0; p < prompts && !cancel.cancelled(); ++p) {
        if (std::optional<ApiError> e = Echo(req, parsed, p, builder)) {
          if (watch.gone()) return false;
          return WriteError(conn, req.version(), *e, keep);
        }
      }
      if (watch.gone()) return false;
    }
    // One call of the gRPC API for each prompt, with every choice of it (sampling.n): the
    // samples share the prompt's prefill, choice i draws with seed + i, and each message says
    // its choice (index). The calls of a batch run at once, as the server's other streams.
    std::vector<v1::GenerateRequest> requests;
    for (int p = 0; p < prompts; ++p) {
      v1::GenerateRequest& r = requests.emplace_back(parsed.Request(p));
      r.set_request_id(prompts == 1 ? id : absl::StrCat(id, "-", p));
      if (n > 1) r.mutable_sampling()->set_n(n);
    }
    GenerateCalls calls(*stub_, std::move(requests),
                        [&req](grpc::ClientContext& ctx) { Authorize(req, ctx); });
    cancel.Attach(&calls);
    absl::Cleanup detach = [&cancel] { cancel.Attach(nullptr); };
    // The first failure answers for the request; the other calls are cancelled.
    std::optional<ApiError> failed;
    GenerateCalls::Event e;
    // The choice of a message of ours (its call's prompt x n + its index), or -1.
    auto choice = [n](const GenerateCalls::Event& e) {
      const int index = e.message.index();
      return e.end || index < 0 || index >= n ? -1 : e.call * n + index;
    };
    auto ended = [&](const GenerateCalls::Event& e) {
      if (e.end && !e.status.ok() && !failed) {
        failed = FromGrpc(e.status, calls.context(e.call));
        if (calls.overflowed()) {
          failed =
              ApiError{503,
                       absl::StrCat("the answer outgrew ", GenerateCalls::kMaxQueuedBytes >> 20,
                                    " MiB while the client was not reading it; the "
                                    "generation was stopped"),
                       "server_error"};
        }
        calls.CancelAll();
      }
    };
    if (!parsed.stream) {
      while (calls.Next(e)) {
        if (const int c = choice(e); c >= 0) builder.Add(c, e.message);
        ended(e);
      }
      if (watch.gone()) return false;
      if (failed) return WriteError(conn, req.version(), *failed, keep);
      return WriteJson(conn, req.version(), 200, builder.Whole(), keep);
    }
    // Stream: a request the server refuses is an HTTP error (a 429 a client retries), not an
    // event stream, so the header waits until every call has sent its first message or ended.
    std::vector<GenerateCalls::Event> early;
    std::vector<bool> answered(static_cast<size_t>(prompts), false);
    for (int waiting = prompts; waiting > 0 && !failed && calls.Next(e);) {
      ended(e);
      if (!answered[static_cast<size_t>(e.call)]) {
        answered[static_cast<size_t>(e.call)] = true;
        --waiting;
      }
      early.push_back(std::move(e));
    }
    if (failed) {
      if (watch.gone()) return false;
      return WriteError(conn, req.version(), *failed, keep);
    }
    HttpStreamHead head{http::status::ok, req.version()};
    head.set(http::field::content_type, "text/event-stream");
    head.set(http::field::cache_control, "no-cache");
    head.keep_alive(keep);
    bool written = conn.WriteHead(head);
    auto event = [&](const std::string& data) {
      if (!written) return;
      written = conn.WriteChunk(absl::StrCat("data: ", data, "\n\n"));
      if (!written) cancel();  // the client is gone: stop generating for it
    };
    auto send = [&](const GenerateCalls::Event& e) {
      if (const int c = choice(e); c >= 0 && !failed) {
        for (const std::string& chunk : builder.Chunks(c, e.message)) event(chunk);
      }
      ended(e);
    };
    for (const GenerateCalls::Event& x : early) send(x);
    while (calls.Next(e)) send(e);
    if (failed) {
      event(ErrorJson(*failed));
    } else if (parsed.include_usage) {
      event(builder.UsageChunk());
    }
    event("[DONE]");
    if (written) written = conn.WriteLastChunk();
    return written && !watch.gone() && keep;
  }

  HttpFrontDoorConfig config_;
  std::unique_ptr<v1::Generation::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
  const int64_t started_;
  std::unique_ptr<HttpServer> server_;
  absl::Mutex mu_;  // the caches below
  std::optional<v1::ModelInfo> info_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int32_t, std::string> token_texts_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<std::unique_ptr<HttpFrontDoor>> HttpFrontDoor::Start(
    const HttpFrontDoorConfig& config, std::shared_ptr<grpc::Channel> channel) {
  if (config.max_connections < 1) {
    return absl::InvalidArgumentError("the HTTP front door needs max_connections >= 1");
  }
  auto impl = std::make_unique<Impl>(config, std::move(channel));
  IG_RETURN_IF_ERROR(impl->Start());
  std::unique_ptr<HttpFrontDoor> door(new HttpFrontDoor(std::move(impl)));
  door->port_ = door->impl_->port();
  return door;
}

HttpFrontDoor::HttpFrontDoor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpFrontDoor::~HttpFrontDoor() { Shutdown(); }

void HttpFrontDoor::Shutdown() { impl_->Shutdown(); }

}  // namespace infinigen::openai
