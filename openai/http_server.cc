#include "openai/http_server.h"

#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <list>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"

namespace infinigen::openai {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
namespace ssl = net::ssl;
using tcp = net::ip::tcp;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// After an answer sent before the request was read to its end (413): stops sending and reads
// what the client still sends (for up to 2 s), so that closing does not reset the connection
// before the client has read the answer.
void Drain(tcp::socket& socket) {
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

// Whether a read failed because the client went away (not because it sent something wrong).
bool ClientLeft(const beast::error_code& ec) {
  return ec == http::error::end_of_stream || ec == net::error::eof ||
         ec == net::error::connection_reset || ec == ssl::error::stream_truncated;
}

}  // namespace

bool WriteJson(HttpConnection& c, unsigned version, int status, const std::string& body,
               bool keep_alive, int retry_after) {
  HttpResponse res{static_cast<http::status>(status), version};
  res.set(http::field::content_type, "application/json");
  if (retry_after > 0) res.set(http::field::retry_after, std::to_string(retry_after));
  res.keep_alive(keep_alive);
  res.body() = body;
  res.prepare_payload();
  return c.Write(res) && keep_alive;
}

bool WriteError(HttpConnection& c, unsigned version, const ApiError& e, bool keep_alive) {
  return WriteJson(c, version, e.http_status, ErrorJson(e), keep_alive, e.retry_after_seconds);
}

class HttpServer::Impl {
 public:
  Impl(const HttpServerConfig& config, HttpHandler handler)
      : config_(config), handler_(std::move(handler)) {}

  absl::Status UseTls() {
    if (config_.tls.cert.empty() && config_.tls.key.empty()) return absl::OkStatus();
    tls_.emplace(ssl::context::tls_server);
    tls_->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                      ssl::context::no_sslv3 | ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1);
    beast::error_code ec;
    tls_->use_certificate_chain_file(config_.tls.cert, ec);
    if (ec) return TlsError("certificate", config_.tls.cert, ec);
    tls_->use_private_key_file(config_.tls.key, ssl::context::pem, ec);
    if (ec) return TlsError("key", config_.tls.key, ec);
    if (!config_.tls.ca.empty()) {
      tls_->load_verify_file(config_.tls.ca, ec);
      if (ec) return TlsError("client CA", config_.tls.ca, ec);
      tls_->set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert);
    }
    return absl::OkStatus();
  }

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
    port_ = acceptor_.local_endpoint().port();
    accept_thread_ = std::thread([this] { AcceptLoop(); });
    return port_;
  }

  int port() const { return port_; }
  bool tls() const { return tls_.has_value(); }

  void Shutdown() {
    if (stopping_.exchange(true)) return;
    if (accept_thread_.joinable()) accept_thread_.join();
    {
      absl::MutexLock l(&mu_);
      for (Connection& c : connections_) {
        if (c.cancel) c.cancel();
        ::shutdown(c.fd, SHUT_RDWR);
      }
    }
    Reap(/*all=*/true);
  }

 private:
  struct Connection {
    int fd = -1;
    std::function<void()> cancel;  // the handler's work in progress (mu_)
    std::atomic<bool> done{false};
    // While it waits for a request (or its TLS handshake): since when (steady clock, ms); 0
    // while answering one.
    std::atomic<int64_t> waiting_since_ms{0};
    std::thread thread;
  };

  // A connection over `Stream` (a TCP socket, or TLS over one).
  template <class Stream>
  class StreamConnection final : public HttpConnection {
   public:
    StreamConnection(Impl& server, Connection& c, Stream& stream)
        : server_(server), c_(c), stream_(stream) {}
    bool Write(HttpResponse& response) override {
      beast::error_code ec;
      http::write(stream_, response, ec);
      return !ec;
    }
    bool WriteHead(HttpStreamHead& head) override {
      head.chunked(true);
      http::response_serializer<http::empty_body> serializer{head};
      beast::error_code ec;
      http::write_header(stream_, serializer, ec);
      return !ec;
    }
    bool WriteChunk(std::string_view data) override {
      beast::error_code ec;
      net::write(stream_, http::make_chunk(net::buffer(data.data(), data.size())), ec);
      return !ec;
    }
    bool WriteLastChunk() override {
      beast::error_code ec;
      net::write(stream_, http::make_chunk_last(), ec);
      return !ec;
    }
    int fd() const override { return c_.fd; }
    void OnShutdown(std::function<void()> cancel) override {
      bool now = false;
      {
        absl::MutexLock l(&server_.mu_);
        c_.cancel = std::move(cancel);
        now = c_.cancel && server_.stopping_.load();
      }
      if (now) c_.cancel();
    }

   private:
    Impl& server_;
    Connection& c_;
    Stream& stream_;
  };

  static absl::Status TlsError(const char* what, const std::string& path,
                               const beast::error_code& ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("the HTTP port's TLS ", what, " '", path, "' cannot be used: ", ec.message()));
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
        // Over TLS an answer would need a handshake on this thread: the client sees the
        // connection close instead (and retries, as for a 503).
        if (!tls_.has_value()) {
          ApiError e{503,
                     absl::StrCat("this server holds its limit of ", config_.max_connections,
                                  " HTTP connections; retry shortly"),
                     "service_unavailable"};
          e.retry_after_seconds = 1;
          Connection refused;
          StreamConnection<tcp::socket> conn(*this, refused, socket);
          WriteError(conn, 11, e, /*keep_alive=*/false);
        }
        continue;
      }
      Connection& c = connections_.emplace_back();
      c.fd = socket.native_handle();
      c.waiting_since_ms.store(NowMs());
      c.thread = std::thread([this, &c, s = std::move(socket)]() mutable {
        if (tls_.has_value()) {
          ssl::stream<tcp::socket> stream(std::move(s), *tls_);
          beast::error_code handshake;
          stream.handshake(ssl::stream_base::server, handshake);  // within the idle timeout
          if (!handshake) Serve(stream, c);
          Close(stream.next_layer());
        } else {
          Serve(s, c);
          Close(s);
        }
        c.done.store(true);
      });
    }
    beast::error_code ec;
    acceptor_.close(ec);
  }

  // Without TLS's close_notify exchange (which would wait for the client).
  static void Close(tcp::socket& socket) {
    beast::error_code ec;
    socket.shutdown(tcp::socket::shutdown_both, ec);
    socket.close(ec);
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

  template <class Stream>
  void Serve(Stream& stream, Connection& c) {
    StreamConnection<Stream> conn(*this, c, stream);
    beast::flat_buffer buffer;
    while (!stopping_.load()) {
      http::request_parser<http::string_body> parser;
      parser.body_limit(config_.max_body_bytes);
      parser.header_limit(64 * 1024);
      beast::error_code ec;
      c.waiting_since_ms.store(NowMs());
      http::read(stream, buffer, parser, ec);
      c.waiting_since_ms.store(0);
      if (ClientLeft(ec) || stopping_.load()) break;
      if (ec == http::error::body_limit) {
        WriteError(conn, 11,
                   {413, absl::StrCat("the request body is larger than this server's limit of ",
                                      config_.max_body_bytes, " bytes")},
                   false);
        Drain(beast::get_lowest_layer(stream));
        break;
      }
      if (ec) {
        WriteError(conn, 11, {400, absl::StrCat("malformed HTTP request: ", ec.message())}, false);
        break;
      }
      const HttpRequest& req = parser.get();
      if (!handler_(req, conn) || !req.keep_alive()) break;
    }
  }

  HttpServerConfig config_;
  HttpHandler handler_;
  std::optional<ssl::context> tls_;
  net::io_context io_;
  tcp::acceptor acceptor_{io_};
  int port_ = 0;
  std::thread accept_thread_;
  std::atomic<bool> stopping_{false};
  absl::Mutex mu_;
  std::list<Connection> connections_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerConfig& config,
                                                              HttpHandler handler) {
  auto impl = std::make_unique<Impl>(config, std::move(handler));
  if (absl::Status st = impl->UseTls(); !st.ok()) return st;
  if (absl::StatusOr<int> port = impl->Listen(); !port.ok()) return port.status();
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { Shutdown(); }

int HttpServer::port() const { return impl_->port(); }

bool HttpServer::tls() const { return impl_->tls(); }

void HttpServer::Shutdown() { impl_->Shutdown(); }

}  // namespace infinigen::openai
