#include "openai/http_front_door.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cmath>
#include <ctime>
#include <functional>
#include <list>
#include <mutex>
#include <random>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "infinigen/v1/generation.grpc.pb.h"
#include "openai/openai_json.h"

namespace infinigen::openai {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using Request = http::request<http::string_body>;

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

}  // namespace

class HttpFrontDoor::Impl {
 public:
  Impl(const HttpFrontDoorConfig& config, std::shared_ptr<grpc::Channel> channel)
      : config_(config),
        stub_(v1::Generation::NewStub(channel)),
        health_(grpc::health::v1::Health::NewStub(channel)),
        started_(static_cast<int64_t>(std::time(nullptr))) {}

  absl::StatusOr<int> Listen() {
    std::vector<std::string> parts = absl::StrSplit(config_.listen, absl::MaxSplits(':', 1));
    int port = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[1], &port) || port < 0 || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("--http_listen must be host:port, not '", config_.listen, "'"));
    }
    beast::error_code ec;
    const auto address =
        net::ip::make_address(parts[0] == "localhost" ? "127.0.0.1" : parts[0], ec);
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("--http_listen: '", parts[0], "' is not an IP address: ", ec.message()));
    }
    const tcp::endpoint endpoint(address, static_cast<uint16_t>(port));
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(net::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(net::socket_base::max_listen_connections, ec);
    if (!ec) acceptor_.non_blocking(true, ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen for HTTP on ", config_.listen, ": ", ec.message()));
    }
    accept_thread_ = std::thread([this] { AcceptLoop(); });
    return acceptor_.local_endpoint().port();
  }

  void Shutdown() {
    if (stopping_.exchange(true)) return;
    if (accept_thread_.joinable()) accept_thread_.join();
    {
      absl::MutexLock l(&mu_);
      for (Connection& c : connections_) {
        for (grpc::ClientContext* call : c.calls) call->TryCancel();
        ::shutdown(c.fd, SHUT_RDWR);
      }
    }
    Reap(/*all=*/true);
  }

 private:
  struct Connection {
    int fd = -1;
    std::vector<grpc::ClientContext*> calls;  // the generation in progress, if any (mu_)
    std::atomic<bool> done{false};
    // While it waits for a request: since when (steady clock, ms); 0 while answering one.
    std::atomic<int64_t> waiting_since_ms{0};
    std::thread thread;
  };

  static int64_t NowMs() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  // Closes the connections that have waited for a request longer than idle_timeout (their
  // threads' reads then fail and they end).
  void CloseIdle() {
    const int64_t limit = absl::ToInt64Milliseconds(config_.idle_timeout);
    const int64_t now = NowMs();
    absl::MutexLock l(&mu_);
    for (Connection& c : connections_) {
      const int64_t since = c.waiting_since_ms.load();
      if (since != 0 && now - since > limit) ::shutdown(c.fd, SHUT_RDWR);
    }
  }

  void AcceptLoop() {
    const int fd = acceptor_.native_handle();
    while (!stopping_.load()) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 200) <= 0) {
        Reap(/*all=*/false);
        CloseIdle();
        continue;
      }
      beast::error_code ec;
      tcp::socket socket(io_);
      acceptor_.accept(socket, ec);
      if (ec) continue;
      socket.non_blocking(false, ec);
      socket.set_option(tcp::no_delay(true), ec);
      Reap(/*all=*/false);
      absl::MutexLock l(&mu_);
      if (static_cast<int>(connections_.size()) >= config_.max_connections) {
        ApiError e{503,
                   absl::StrCat("this server holds its limit of ", config_.max_connections,
                                " HTTP connections; retry shortly"),
                   "service_unavailable"};
        e.retry_after_seconds = 1;
        WriteError(socket, 11, e, /*keep_alive=*/false);
        continue;
      }
      Connection& c = connections_.emplace_back();
      c.fd = socket.native_handle();
      c.waiting_since_ms.store(NowMs());
      c.thread = std::thread([this, &c, s = std::move(socket)]() mutable {
        Serve(s, c);
        c.done.store(true);
      });
    }
    beast::error_code ec;
    acceptor_.close(ec);
  }

  // Joins the threads of connections that ended (all of them, waiting, when `all`).
  void Reap(bool all) {
    std::list<Connection> ended;
    {
      absl::MutexLock l(&mu_);
      for (auto it = connections_.begin(); it != connections_.end();) {
        if (all || it->done.load()) {
          auto next = std::next(it);
          ended.splice(ended.end(), connections_, it);
          it = next;
        } else {
          ++it;
        }
      }
    }
    for (Connection& c : ended) c.thread.join();
  }

  void Serve(tcp::socket& socket, Connection& c) {
    beast::flat_buffer buffer;
    while (!stopping_.load()) {
      http::request_parser<http::string_body> parser;
      parser.body_limit(config_.max_body_bytes);
      parser.header_limit(64 * 1024);
      beast::error_code ec;
      c.waiting_since_ms.store(NowMs());
      http::read(socket, buffer, parser, ec);
      c.waiting_since_ms.store(0);
      if (ec == http::error::end_of_stream || ec == net::error::eof ||
          ec == net::error::connection_reset || stopping_.load()) {
        break;
      }
      if (ec == http::error::body_limit) {
        WriteError(socket, 11,
                   {413, absl::StrCat("the request body is larger than this server's limit of ",
                                      config_.max_body_bytes, " bytes")},
                   false);
        Drain(socket);
        break;
      }
      if (ec) {
        WriteError(socket, 11, {400, absl::StrCat("malformed HTTP request: ", ec.message())},
                   false);
        break;
      }
      const Request& req = parser.get();
      if (!Handle(req, socket, c) || !req.keep_alive()) break;
    }
    beast::error_code ec;
    socket.shutdown(tcp::socket::shutdown_both, ec);
    socket.close(ec);
  }

  // After an answer sent before the request was read to its end (413): stops sending and reads
  // what the client still sends (for up to 2 s), so that closing does not reset the connection
  // before the client has read the answer.
  static void Drain(tcp::socket& socket) {
    beast::error_code ec;
    socket.shutdown(tcp::socket::shutdown_send, ec);
    const int fd = socket.native_handle();
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    char sink[1 << 16];
    while (std::chrono::steady_clock::now() < end) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      if (::recv(fd, sink, sizeof(sink), 0) <= 0) return;
    }
  }

  // Answers one request; false when the connection must close.
  bool Handle(const Request& req, tcp::socket& socket, Connection& c) {
    std::string path(req.target());
    if (const size_t q = path.find('?'); q != std::string::npos) path.resize(q);
    const bool keep = req.keep_alive();
    auto method = [&](http::verb want) {
      if (req.method() == want) return true;
      WriteError(socket, req.version(),
                 {405, absl::StrCat(path, " takes ", std::string(http::to_string(want)))}, keep);
      return false;
    };
    if (path == "/health") return !method(http::verb::get) ? keep : Health(req, socket);
    if (path == "/v1/models") return !method(http::verb::get) ? keep : Models(req, socket);
    if (path == "/v1/completions") {
      return !method(http::verb::post) ? keep : Generate(Endpoint::kCompletions, req, socket, c);
    }
    if (path == "/v1/chat/completions") {
      return !method(http::verb::post) ? keep
                                       : Generate(Endpoint::kChatCompletions, req, socket, c);
    }
    ApiError e{404,
               absl::StrCat("no route ", path,
                            "; this server has /v1/completions, /v1/chat/completions, "
                            "/v1/models and /health"),
               "not_found_error"};
    return WriteError(socket, req.version(), e, keep);
  }

  static void Authorize(const Request& req, grpc::ClientContext& ctx) {
    auto it = req.find(http::field::authorization);
    if (it != req.end()) ctx.AddMetadata("authorization", std::string(it->value()));
  }

  static bool WriteJson(tcp::socket& socket, unsigned version, int status, const std::string& body,
                        bool keep_alive, int retry_after = 0) {
    http::response<http::string_body> res{static_cast<http::status>(status), version};
    res.set(http::field::content_type, "application/json");
    if (retry_after > 0) res.set(http::field::retry_after, std::to_string(retry_after));
    res.keep_alive(keep_alive);
    res.body() = body;
    res.prepare_payload();
    beast::error_code ec;
    http::write(socket, res, ec);
    return !ec && keep_alive;
  }

  static bool WriteError(tcp::socket& socket, unsigned version, const ApiError& e,
                         bool keep_alive) {
    return WriteJson(socket, version, e.http_status, ErrorJson(e), keep_alive,
                     e.retry_after_seconds);
  }

  bool Health(const Request& req, tcp::socket& socket) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    grpc::health::v1::HealthCheckRequest check;
    check.set_service(v1::Generation::service_full_name());
    grpc::health::v1::HealthCheckResponse answer;
    const grpc::Status st = health_->Check(&ctx, check, &answer);
    const bool serving =
        st.ok() && answer.status() == grpc::health::v1::HealthCheckResponse::SERVING;
    return WriteJson(socket, req.version(), serving ? 200 : 503,
                     serving ? R"({"status":"ok"})" : R"({"status":"unavailable"})",
                     req.keep_alive(), serving ? 0 : 1);
  }

  // The served model's name and context (cached after the first answer).
  grpc::Status Info(const Request& req, v1::ModelInfo& out) {
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

  bool Models(const Request& req, tcp::socket& socket) {
    v1::ModelInfo info;
    grpc::ClientContext ctx;  // only for FromGrpc's metadata
    const grpc::Status st = Info(req, info);
    if (!st.ok()) return WriteError(socket, req.version(), FromGrpc(st, ctx), req.keep_alive());
    const nlohmann::json body = {{"object", "list"},
                                 {"data",
                                  {{{"id", info.model()},
                                    {"object", "model"},
                                    {"created", started_},
                                    {"owned_by", "infinigen"},
                                    {"max_model_len", info.max_context_tokens()}}}}};
    // A checkpoint's name may hold any bytes: invalid UTF-8 becomes U+FFFD, never an exception.
    return WriteJson(socket, req.version(), 200,
                     body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
                     req.keep_alive());
  }

  // A token's text (the model's decoding of that id alone), for logprobs.
  std::string TokenText(const Request& req, int32_t id) {
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

  bool Generate(Endpoint endpoint, const Request& req, tcp::socket& socket, Connection& c) {
    const bool keep = req.keep_alive();
    ParsedRequest parsed;
    ApiError error;
    if (!ParseRequest(endpoint, req.body(), parsed, error)) {
      return WriteError(socket, req.version(), error, keep);
    }
    v1::ModelInfo info;
    if (Info(req, info).ok() && !parsed.model.empty() && parsed.model != info.model()) {
      return WriteError(socket, req.version(),
                        {404,
                         absl::StrCat("the model '", parsed.model,
                                      "' does not exist here; this "
                                      "server serves '",
                                      info.model(), "' (GET /v1/models)"),
                         "invalid_request_error", "model", "model_not_found"},
                        keep);
    }
    const std::string model = info.model().empty() ? parsed.model : info.model();
    const std::string id =
        absl::StrCat(endpoint == Endpoint::kChatCompletions ? "chatcmpl-" : "cmpl-", RandomHex(12));
    const int n = parsed.n;
    ResponseBuilder builder(
        endpoint, id, static_cast<int64_t>(std::time(nullptr)), model, parsed.top_logprobs,
        [this, &req](int32_t token) { return TokenText(req, token); }, n);
    // n > 1: n calls of the gRPC API, choice i with seed + i when a seed was given (each draws
    // its own otherwise); they do not share their prefill yet.
    std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
    std::vector<v1::GenerateRequest> requests(static_cast<size_t>(n), parsed.request);
    for (int i = 0; i < n; ++i) {
      contexts.push_back(std::make_unique<grpc::ClientContext>());
      Authorize(req, *contexts.back());
      v1::GenerateRequest& r = requests[static_cast<size_t>(i)];
      r.set_request_id(n == 1 ? id : absl::StrCat(id, "-", i));
      if (n > 1 && r.sampling().has_seed()) {
        r.mutable_sampling()->set_seed(r.sampling().seed() + static_cast<uint64_t>(i));
      }
    }
    auto cancel_all = [&contexts] {
      for (auto& ctx : contexts) ctx->TryCancel();
    };
    {
      absl::MutexLock l(&mu_);
      for (auto& ctx : contexts) c.calls.push_back(ctx.get());
    }
    absl::Cleanup forget = [this, &c] {
      absl::MutexLock l(&mu_);
      c.calls.clear();
    };
    if (stopping_.load()) cancel_all();
    HangupWatch watch(c.fd, cancel_all);
    std::vector<std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>>> readers;
    for (int i = 0; i < n; ++i) {
      readers.push_back(stub_->Generate(contexts[static_cast<size_t>(i)].get(),
                                        requests[static_cast<size_t>(i)]));
    }
    std::vector<grpc::Status> statuses(static_cast<size_t>(n));
    // Each choice's stream on its own thread (choice 0 on this one); `each(i, message)` per
    // message, then its status.
    auto drain = [&](auto each, const std::vector<v1::GenerateResponse>* first) {
      auto run = [&](int i) {
        v1::GenerateResponse m;
        if (first != nullptr) each(i, (*first)[static_cast<size_t>(i)]);
        while (readers[static_cast<size_t>(i)]->Read(&m)) each(i, m);
        statuses[static_cast<size_t>(i)] = readers[static_cast<size_t>(i)]->Finish();
        if (!statuses[static_cast<size_t>(i)].ok()) cancel_all();
      };
      std::vector<std::thread> threads;
      for (int i = 1; i < n; ++i) threads.emplace_back(run, i);
      run(0);
      for (std::thread& t : threads) t.join();
    };
    auto failed = [&]() -> const grpc::Status* {
      for (const grpc::Status& st : statuses) {
        if (!st.ok() && st.error_code() != grpc::StatusCode::CANCELLED) return &st;
      }
      for (const grpc::Status& st : statuses) {
        if (!st.ok()) return &st;
      }
      return nullptr;
    };
    auto error_of = [&](const grpc::Status& st) {
      const size_t i = static_cast<size_t>(&st - statuses.data());
      return FromGrpc(st, *contexts[i]);
    };
    if (!parsed.stream) {
      drain([&](int i, const v1::GenerateResponse& m) { builder.Add(i, m); }, nullptr);
      if (watch.gone()) return false;
      if (const grpc::Status* st = failed()) {
        return WriteError(socket, req.version(), error_of(*st), keep);
      }
      return WriteJson(socket, req.version(), 200, builder.Whole(), keep);
    }
    // Stream: a request the server refuses is an HTTP error, not an event stream, so every
    // choice's first message (or failure) comes before the header.
    std::vector<v1::GenerateResponse> first(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      if (readers[static_cast<size_t>(i)]->Read(&first[static_cast<size_t>(i)])) continue;
      statuses[static_cast<size_t>(i)] = readers[static_cast<size_t>(i)]->Finish();
      if (statuses[static_cast<size_t>(i)].ok()) continue;  // an empty stream: nothing to send
      cancel_all();
      for (int j = 0; j < n; ++j) {
        if (j == i) continue;
        v1::GenerateResponse m;
        while (readers[static_cast<size_t>(j)]->Read(&m)) {
        }
        readers[static_cast<size_t>(j)]->Finish().ok();
      }
      if (watch.gone()) return false;
      return WriteError(socket, req.version(), error_of(statuses[static_cast<size_t>(i)]), keep);
    }
    http::response<http::empty_body> head{http::status::ok, req.version()};
    head.set(http::field::content_type, "text/event-stream");
    head.set(http::field::cache_control, "no-cache");
    head.keep_alive(keep);
    head.chunked(true);
    http::response_serializer<http::empty_body> serializer{head};
    beast::error_code ec;
    http::write_header(socket, serializer, ec);
    std::mutex write_mu;  // the choices' threads write events in turn
    auto event = [&](const std::string& data) {
      std::lock_guard<std::mutex> l(write_mu);
      if (ec) return;
      const std::string line = absl::StrCat("data: ", data, "\n\n");
      net::write(socket, http::make_chunk(net::buffer(line)), ec);
      if (ec) cancel_all();  // the client is gone: stop generating for it
    };
    drain(
        [&](int i, const v1::GenerateResponse& m) {
          for (const std::string& chunk : builder.Chunks(i, m)) event(chunk);
        },
        &first);
    if (const grpc::Status* st = failed()) {
      event(ErrorJson(error_of(*st)));
    } else if (parsed.include_usage) {
      event(builder.UsageChunk());
    }
    event("[DONE]");
    if (!ec) net::write(socket, http::make_chunk_last(), ec);
    return !ec && !watch.gone() && keep;
  }

  HttpFrontDoorConfig config_;
  std::unique_ptr<v1::Generation::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
  const int64_t started_;
  net::io_context io_;
  tcp::acceptor acceptor_{io_};
  std::thread accept_thread_;
  std::atomic<bool> stopping_{false};
  absl::Mutex mu_;
  std::list<Connection> connections_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::ModelInfo> info_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int32_t, std::string> token_texts_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<std::unique_ptr<HttpFrontDoor>> HttpFrontDoor::Start(
    const HttpFrontDoorConfig& config, std::shared_ptr<grpc::Channel> channel) {
  if (config.max_connections < 1) {
    return absl::InvalidArgumentError("the HTTP front door needs max_connections >= 1");
  }
  auto impl = std::make_unique<Impl>(config, std::move(channel));
  absl::StatusOr<int> port = impl->Listen();
  if (!port.ok()) return port.status();
  std::unique_ptr<HttpFrontDoor> door(new HttpFrontDoor(std::move(impl)));
  door->port_ = *port;
  return door;
}

HttpFrontDoor::HttpFrontDoor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpFrontDoor::~HttpFrontDoor() { Shutdown(); }

void HttpFrontDoor::Shutdown() { impl_->Shutdown(); }

}  // namespace infinigen::openai
