#include "tests/support/http_get.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <sstream>

namespace infinigen::testing {

HttpReply HttpRequest(int port, const std::string& method, const std::string& path) {
  HttpReply reply;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return reply;
  }
  const std::string request =
      method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n";
  if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    ::close(fd);
    return reply;
  }
  std::string all;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) all.append(buf, n);
  ::close(fd);
  if (all.rfind("HTTP/1.1 ", 0) != 0) return reply;
  reply.code = std::atoi(all.c_str() + 9);
  const size_t body = all.find("\r\n\r\n");
  if (body != std::string::npos) reply.body = all.substr(body + 4);
  return reply;
}

double MetricValue(const std::string& page, const std::string& metric) {
  std::istringstream lines(page);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(metric, 0) != 0 || line.size() == metric.size()) continue;
    const char next = line[metric.size()];
    if (next != ' ' && next != '{') continue;
    return std::strtod(line.c_str() + line.rfind(' ') + 1, nullptr);
  }
  return -1;
}

}  // namespace infinigen::testing
