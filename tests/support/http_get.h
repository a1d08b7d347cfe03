// A minimal HTTP/1.1 client for tests of the services' /metrics endpoints: one request on
// 127.0.0.1, the whole reply read until the server closes the connection.
#pragma once

#include <string>

namespace infinigen::testing {

struct HttpReply {
  int code = 0;  // 0: no reply (refused, or not HTTP)
  std::string body;
};

// Sends "<method> <path> HTTP/1.1" to 127.0.0.1:port.
HttpReply HttpRequest(int port, const std::string& method, const std::string& path);
inline HttpReply HttpGet(int port, const std::string& path) {
  return HttpRequest(port, "GET", path);
}

// The value of the first sample of `metric` (a line "<metric> <value>" or "<metric>{...}
// <value>") in a Prometheus text page; -1 if absent.
double MetricValue(const std::string& page, const std::string& metric);

}  // namespace infinigen::testing
