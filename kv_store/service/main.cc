// infinigen-kvstore: the KV store service. Flags become one validated KvStoreConfig here; the
// server enables gRPC health checking and reflection and exposes Prometheus metrics over HTTP.
// SIGTERM/SIGINT drain it: health NOT_SERVING, Shutdown(deadline), join threads, free memory.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server_builder.h>

#include <iostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/flags.h"
#include "common/grpc/health.h"
#include "common/grpc/listen.h"
#include "common/grpc/tls.h"
#include "common/shutdown_signal.h"
#include "infinigen/kvstore/v1/kvstore.grpc.pb.h"
#include "kv_store/service/kvstore_metrics.h"
#include "kv_store/service/kvstore_service.h"
#if INFINIGEN_HAVE_UCX
#include "kv_store/ucx/ucx_data_plane.h"
#endif

int main(int argc, char** argv) {
  infinigen::KvStoreConfig config;
  std::string listen = "127.0.0.1:50061";
  infinigen::TlsFiles tls;
  int64_t capacity_mb = 1024, drain_seconds = 5;
  int64_t prefault_ahead_mb = static_cast<int64_t>(infinigen::kServedPrefaultAheadBytes >> 20);
  int metrics_port = 0, ucx_port = 0;
  bool check_flags = false, ucx_appends = true;
  infinigen::FlagSet flags("infinigen-kvstore", "[--listen HOST:PORT] [--capacity-mb N] [flags]",
                           "Host-memory KV caches served to workers.");
  flags.String("listen", &listen, "gRPC address to serve on (host:port)");
  flags.Int("capacity-mb", &capacity_mb, "host memory for K/V, in MiB");
  flags.Int("block-tokens", &config.block_tokens, "rows per arena block for the widest rows");
  flags.Int("max-row-bytes", &config.max_row_bytes,
            "widest K/V row accepted (head_dim x dtype size)");
  flags.Int("gather-threads", &config.gather_threads, "threads copying rows for large gathers");
  flags.Seconds("lease-seconds", &config.lease,
                "a worker's sequences are freed this long after its last renewal");
  flags.String("shm-path", &config.shm_path,
               "file (e.g. /dev/shm/kvstore) holding the arena for collocated workers; empty: a "
               "memfd");
  flags.Bool("shared-memory", &config.shared_memory,
             "share the arena with collocated workers (shm transport)");
  flags.Bool("huge-pages", &config.huge_pages,
             "back the arena with huge pages when the system has them");
  flags.Int("prefault-ahead-mb", &prefault_ahead_mb,
            "arena MiB committed ahead of the blocks in use (at most the arena), on an "
            "idle-priority thread, so that appends do not wait for page faults (0: off)");
  flags.Int("metrics-port", &metrics_port, "Prometheus metrics on this HTTP port (0: off)");
  flags.Int("ucx-port", &ucx_port, "serve gathers and appends over UCX on this TCP port (0: off)");
  flags.Bool("ucx-appends", &ucx_appends,
             "take workers' append batches over UCX too (false: they append over gRPC)");
  flags.Int("drain-seconds", &drain_seconds, "how long shutdown waits for calls in flight");
  flags.String("tls-cert", &tls.cert, "serve TLS with this certificate chain (PEM)");
  flags.String("tls-key", &tls.key, "the private key of --tls-cert (PEM)");
  flags.String("tls-client-ca", &tls.ca,
               "require client certificates signed by this CA (mTLS between the services)");
  flags.Bool("check-flags", &check_flags, "validate the flags and exit (for deployment checks)");
  auto parsed = flags.Parse(argc - 1, argv + 1);
  if (!parsed.ok()) {
    std::cerr << "infinigen-kvstore: " << parsed.status().message() << "\n";
    return 2;
  }
  if (!*parsed) return 0;
  if (capacity_mb < 1 || capacity_mb > (int64_t{1} << 30)) {
    std::cerr << "infinigen-kvstore: --capacity-mb must be in [1, 2^30]\n";
    return 2;
  }
  if (prefault_ahead_mb < 0 || prefault_ahead_mb > (int64_t{1} << 30)) {
    std::cerr << "infinigen-kvstore: --prefault-ahead-mb must be in [0, 2^30] (more than "
                 "--capacity-mb commits the whole arena)\n";
    return 2;
  }
  config.capacity_bytes = static_cast<size_t>(capacity_mb) << 20;
  config.prefault_ahead_bytes = static_cast<size_t>(prefault_ahead_mb) << 20;
  if (auto st = config.Validate(); !st.ok()) {
    std::cerr << "infinigen-kvstore: " << st.message() << "\n";
    return 2;
  }
  if (check_flags) return 0;

  auto store = infinigen::KvStore::Create(config);
  if (!store.ok()) {
    std::cerr << "infinigen-kvstore: " << store.status().message() << "\n";
    return 1;
  }
  infinigen::KvStoreService service(**store);
  std::unique_ptr<infinigen::KvStoreMetrics> metrics;
  if (metrics_port > 0) {
    auto m = infinigen::KvStoreMetrics::Start(**store, metrics_port);
    if (!m.ok()) {
      std::cerr << "infinigen-kvstore: " << m.status().message() << "\n";
      return 1;
    }
    metrics = std::move(*m);
  }

#if INFINIGEN_HAVE_UCX
  std::unique_ptr<infinigen::UcxDataServer> ucx;
  if (ucx_port > 0) {
    infinigen::UcxAppendHandler on_append;  // none: append messages are refused
    if (ucx_appends) {
      on_append = [&service](std::span<const uint8_t> request, std::span<const uint8_t> rows) {
        return service.AppendBatchWithRows(request, rows);
      };
    }
    auto u = infinigen::UcxDataServer::Start(**store, ucx_port, std::move(on_append));
    if (!u.ok()) {
      std::cerr << "infinigen-kvstore: " << u.status().message() << "\n";
      return 1;
    }
    ucx = std::move(*u);
    service.set_ucx_port(ucx->port(), ucx_appends);
  }
#else
  if (ucx_port > 0) {
    std::cerr << "infinigen-kvstore: --ucx-port: this build has no UCX\n";
    return 2;
  }
#endif
  auto credentials = infinigen::MakeServerCredentials(tls);
  if (!credentials.ok()) {
    std::cerr << "infinigen-kvstore: " << credentials.status().message() << "\n";
    return 2;
  }
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  infinigen::AddHealthService(builder);
  int port = 0;
  infinigen::Listen(builder, listen, *credentials, &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(infinigen::kMaxKvMessageBytes));
  builder.SetMaxSendMessageSize(static_cast<int>(infinigen::kMaxKvMessageBytes));
  builder.RegisterService(&service);
  infinigen::InstallShutdownSignalHandlers();  // before serving: a SIGTERM from then on drains
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::cerr << "infinigen-kvstore: " << infinigen::CannotListen(listen) << "\n";
    return 1;
  }
  infinigen::SetHealth(*server, {infinigen::kvstore::v1::KvStore::service_full_name()}, true);
  std::cout << "infinigen-kvstore: serving on port " << port << ", arena "
            << (*store)->arena().share_path() << ", " << (config.capacity_bytes >> 20) << " MiB"
            << ((*store)->arena().huge_pages() ? " (huge pages)" : "") << std::endl;

  absl::Notification stop;
  // Lease reaper: frees the sequences of workers that stopped renewing.
  std::thread reaper([&] {
    while (!stop.WaitForNotificationWithTimeout(absl::Milliseconds(200))) {
      (*store)->ReapExpired(absl::Now());
    }
  });
  infinigen::WaitForShutdownSignal();
  infinigen::SetHealth(*server, {infinigen::kvstore::v1::KvStore::service_full_name()}, false);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(drain_seconds));
  stop.Notify();
  reaper.join();
#if INFINIGEN_HAVE_UCX
  ucx.reset();
#endif
  metrics.reset();
  std::cout << "infinigen-kvstore: stopped" << std::endl;
  return 0;
}
