// Serves GET /metrics (Prometheus text format 0.0.4) on a TCP port, from the collectables
// registered with it, on one thread of its own.
//
// Our own small HTTP endpoint instead of prometheus-cpp's Exposer: that one runs on civetweb,
// whose threads are created with a fixed 100 KiB stack, and glibc refuses such a thread
// (EINVAL) when the process's static TLS is larger than the stack, which the worker's is
// (cuBLASLt and OpenBLAS alone take 150 KiB): a worker built with CUDA could not serve metrics.
// Scrapes are rare and small, so connections are answered one at a time, each closed after its
// reply; a client that stalls is dropped after a short timeout.
#pragma once

#include <prometheus/collectable.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace infinigen {

class MetricsExposer {
 public:
  // Listens on `port` of every interface (0: any free port, see port()).
  static absl::StatusOr<std::unique_ptr<MetricsExposer>> Start(int port);
  ~MetricsExposer();

  // Collected at every scrape, in registration order; kept alive by the exposer.
  void Register(std::shared_ptr<prometheus::Collectable> collectable);
  int port() const { return port_; }

 private:
  MetricsExposer(int listen_fd, int wake_fd, int port);
  void Serve();
  void Answer(int fd);

  const int listen_fd_;
  const int wake_fd_;  // eventfd: written once to stop Serve
  const int port_;
  absl::Mutex mu_;
  std::vector<std::shared_ptr<prometheus::Collectable>> collectables_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace infinigen
