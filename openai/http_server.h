// The HTTP/1.1 server under the OpenAI-compatible front door, on Boost.Beast: plain or TLS (the
// router's own certificate, and its client CA when it requires client certificates), one thread
// per connection (keep-alive: requests one after another), at most max_connections (more are
// answered 503 and closed), a connection that sends no whole request within idle_timeout is
// closed (the TLS handshake included), bodies over max_body_bytes are answered 413. What a
// request means is the handler's (openai/http_front_door.h).
#pragma once

#include <boost/beast/http/empty_body.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/tls_files.h"
#include "openai/api_error.h"

namespace infinigen::openai {

using HttpRequest = boost::beast::http::request<boost::beast::http::string_body>;
using HttpResponse = boost::beast::http::response<boost::beast::http::string_body>;
using HttpStreamHead = boost::beast::http::response<boost::beast::http::empty_body>;

struct HttpServerConfig {
  std::string listen = "127.0.0.1:8000";  // host:port (port 0: any free one)
  int max_connections = 256;
  size_t max_body_bytes = 4 << 20;  // larger requests: 413
  // A connection that has not sent a whole request this long after the last answer (or its
  // opening) is closed: idle keep-alive connections and slow senders do not hold threads.
  absl::Duration idle_timeout = absl::Seconds(60);
  // TLS when tls.cert is set (with tls.key); tls.ca: clients must present a certificate it
  // signed.
  TlsFiles tls;
};

// One client connection, as a handler sees it while it answers a request. Writes return false
// once the connection failed (the client is gone).
class HttpConnection {
 public:
  virtual ~HttpConnection() = default;
  virtual bool Write(HttpResponse& response) = 0;
  // An event stream: the header (sent chunked), its chunks, then the last chunk.
  virtual bool WriteHead(HttpStreamHead& head) = 0;
  virtual bool WriteChunk(std::string_view data) = 0;
  virtual bool WriteLastChunk() = 0;
  // The connection's socket, to watch for the client hanging up.
  virtual int fd() const = 0;
  // Runs `cancel` if the server shuts down while it is set (nullptr clears it): the handler's
  // work in progress for this connection.
  virtual void OnShutdown(std::function<void()> cancel) = 0;
};

// Answers one request; false when the connection must close.
using HttpHandler = std::function<bool(const HttpRequest&, HttpConnection&)>;

// A JSON response with OpenAI's error shape or any body; false when the connection must close
// (the write failed or keep_alive is false).
bool WriteJson(HttpConnection& c, unsigned version, int status, const std::string& body,
               bool keep_alive, int retry_after = 0);
bool WriteError(HttpConnection& c, unsigned version, const ApiError& e, bool keep_alive);

class HttpServer {
 public:
  // Listens (INVALID_ARGUMENT for a bad address or unreadable TLS files, UNAVAILABLE when the
  // port cannot be had) and serves on threads of its own.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const HttpServerConfig& config,
                                                           HttpHandler handler);
  ~HttpServer();  // Shutdown()

  int port() const;
  bool tls() const;
  // Stops accepting, cancels what handlers registered (OnShutdown), closes every connection and
  // waits for their threads.
  void Shutdown();

 private:
  class Impl;
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace infinigen::openai
