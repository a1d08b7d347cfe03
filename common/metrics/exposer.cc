#include "common/metrics/exposer.h"

#include <netinet/in.h>
#include <poll.h>
#include <prometheus/text_serializer.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace infinigen {
namespace {

constexpr size_t kMaxRequestBytes = 8192;
constexpr int kClientTimeoutMs = 2000;

// Reads until the end of the request head; false if the client sends too much, stalls or leaves.
bool ReadRequestHead(int fd, std::string* head) {
  const absl::Time deadline = absl::Now() + absl::Milliseconds(kClientTimeoutMs);
  char buf[1024];
  while (head->find("\r\n\r\n") == std::string::npos) {
    if (head->size() > kMaxRequestBytes) return false;
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left_ms <= 0) return false;
    pollfd p = {fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left_ms)) <= 0) return false;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return false;
    head->append(buf, static_cast<size_t>(n));
  }
  return true;
}

void SendAll(int fd, const std::string& data) {
  size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the client left; nothing to do
    sent += static_cast<size_t>(n);
  }
}

std::string Response(const std::string& status, const std::string& content_type,
                     const std::string& body) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsExposer>> MetricsExposer::Start(int port) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics port ", port, " is not in 0..65535"));
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 16) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("metrics port ", port, ": ", std::strerror(err),
                                               " (is another process listening on it?)"));
  }
  const int wake = ::eventfd(0, EFD_CLOEXEC);
  if (wake < 0) {
    ::close(fd);
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  std::unique_ptr<MetricsExposer> e(new MetricsExposer(fd, wake, ntohs(addr.sin_port)));
  e->thread_ = std::thread([raw = e.get()] { raw->Serve(); });
  return e;
}

MetricsExposer::MetricsExposer(int listen_fd, int wake_fd, int port)
    : listen_fd_(listen_fd), wake_fd_(wake_fd), port_(port) {}

MetricsExposer::~MetricsExposer() {
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  ::close(listen_fd_);
  ::close(wake_fd_);
}

void MetricsExposer::Register(std::shared_ptr<prometheus::Collectable> collectable) {
  absl::MutexLock lock(&mu_);
  collectables_.push_back(std::move(collectable));
}

void MetricsExposer::Serve() {
  for (;;) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (::poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (p[1].revents != 0) return;
    if ((p[0].revents & POLLIN) == 0) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Answer(fd);
    ::close(fd);
  }
}

void MetricsExposer::Answer(int fd) {
  // A client that stops reading the reply is dropped too.
  const timeval send_timeout = {kClientTimeoutMs / 1000, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof(send_timeout));
  std::string head;
  if (!ReadRequestHead(fd, &head)) return;
  const std::string line = head.substr(0, head.find("\r\n"));
  const bool get = absl::StartsWith(line, "GET ");
  const bool head_only = absl::StartsWith(line, "HEAD ");
  if (!get && !head_only) {
    SendAll(fd, Response("405 Method Not Allowed", "text/plain", "use GET /metrics\n"));
    return;
  }
  const size_t path_start = line.find(' ') + 1;
  std::string path = line.substr(path_start, line.find(' ', path_start) - path_start);
  path = path.substr(0, path.find('?'));
  if (path != "/metrics") {
    SendAll(fd, Response("404 Not Found", "text/plain", "metrics are served at /metrics\n"));
    return;
  }
  std::vector<prometheus::MetricFamily> families;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& c : collectables_) {
      std::vector<prometheus::MetricFamily> f = c->Collect();
      families.insert(families.end(), std::make_move_iterator(f.begin()),
                      std::make_move_iterator(f.end()));
    }
  }
  std::string reply = Response("200 OK", "text/plain; version=0.0.4",
                               prometheus::TextSerializer().Serialize(families));
  if (head_only) reply.resize(reply.find("\r\n\r\n") + 4);
  SendAll(fd, reply);
}

}  // namespace infinigen
