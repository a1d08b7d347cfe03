// infinigen-kvstore: the KV store service. Flags become one validated KvStoreConfig here; the
// server enables gRPC health checking and reflection and exposes Prometheus metrics over HTTP.
// SIGTERM/SIGINT drain it: health NOT_SERVING, Shutdown(deadline), join threads, free memory.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server_builder.h>

#include <iostream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/grpc/health.h"
#include "common/grpc/tls.h"
#include "common/shutdown_signal.h"
#include "infinigen/kvstore/v1/kvstore.grpc.pb.h"
#include "kv_store/service/kvstore_metrics.h"
#include "kv_store/service/kvstore_service.h"
#if INFINIGEN_HAVE_UCX
#include "kv_store/ucx/ucx_data_plane.h"
#endif

ABSL_FLAG(std::string, listen, "127.0.0.1:50061", "gRPC address to serve on (host:port)");
ABSL_FLAG(int64_t, capacity_mb, 1024, "host memory for K/V, in MiB");
ABSL_FLAG(int64_t, block_tokens, 64, "rows per arena block for the widest rows");
ABSL_FLAG(int64_t, max_row_bytes, 1024, "widest K/V row accepted (head_dim x dtype size)");
ABSL_FLAG(int32_t, gather_threads, 2, "threads copying rows for large gathers");
ABSL_FLAG(int64_t, lease_seconds, 30,
          "a worker's sequences are freed this long after its last renewal");
ABSL_FLAG(std::string, shm_path, "",
          "file (e.g. /dev/shm/kvstore) holding the arena for collocated workers; empty: a memfd");
ABSL_FLAG(bool, shared_memory, true, "share the arena with collocated workers (shm transport)");
ABSL_FLAG(bool, huge_pages, true, "back the arena with huge pages when the system has them");
ABSL_FLAG(int32_t, metrics_port, 0, "Prometheus metrics on this HTTP port (0: off)");
ABSL_FLAG(int32_t, ucx_port, 0, "serve gathers over UCX on this TCP port (0: off)");
ABSL_FLAG(int64_t, drain_seconds, 5, "how long shutdown waits for calls in flight");
ABSL_FLAG(std::string, tls_cert, "", "serve TLS with this certificate chain (PEM)");
ABSL_FLAG(std::string, tls_key, "", "the private key of --tls_cert (PEM)");
ABSL_FLAG(std::string, tls_client_ca, "",
          "require client certificates signed by this CA (mTLS between the services)");
ABSL_FLAG(bool, check_flags, false, "validate the flags and exit (for deployment checks)");

int main(int argc, char** argv) {
  // --help lists this binary's own flags (absl's default matches files named after the binary).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "kv_store/service/main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage("infinigen-kvstore: host-memory KV caches served to workers");
  absl::ParseCommandLine(argc, argv);
  infinigen::KvStoreConfig config;
  config.capacity_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_capacity_mb)) << 20;
  config.block_tokens = absl::GetFlag(FLAGS_block_tokens);
  config.max_row_bytes = absl::GetFlag(FLAGS_max_row_bytes);
  config.gather_threads = absl::GetFlag(FLAGS_gather_threads);
  config.lease = absl::Seconds(absl::GetFlag(FLAGS_lease_seconds));
  config.shm_path = absl::GetFlag(FLAGS_shm_path);
  config.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  config.huge_pages = absl::GetFlag(FLAGS_huge_pages);
  if (auto st = config.Validate(); !st.ok()) {
    std::cerr << "infinigen-kvstore: " << st.message() << "\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_check_flags)) return 0;

  auto store = infinigen::KvStore::Create(config);
  if (!store.ok()) {
    std::cerr << "infinigen-kvstore: " << store.status().message() << "\n";
    return 1;
  }
  infinigen::KvStoreService service(**store);
  std::unique_ptr<infinigen::KvStoreMetrics> metrics;
  if (absl::GetFlag(FLAGS_metrics_port) > 0) {
    auto m = infinigen::KvStoreMetrics::Start(**store, absl::GetFlag(FLAGS_metrics_port));
    if (!m.ok()) {
      std::cerr << "infinigen-kvstore: " << m.status().message() << "\n";
      return 1;
    }
    metrics = std::move(*m);
  }

#if INFINIGEN_HAVE_UCX
  std::unique_ptr<infinigen::UcxGatherServer> ucx;
  if (absl::GetFlag(FLAGS_ucx_port) > 0) {
    auto u = infinigen::UcxGatherServer::Start(**store, absl::GetFlag(FLAGS_ucx_port));
    if (!u.ok()) {
      std::cerr << "infinigen-kvstore: " << u.status().message() << "\n";
      return 1;
    }
    ucx = std::move(*u);
    service.set_ucx_port(ucx->port());
  }
#else
  if (absl::GetFlag(FLAGS_ucx_port) > 0) {
    std::cerr << "infinigen-kvstore: --ucx_port: this build has no UCX\n";
    return 2;
  }
#endif
  auto credentials =
      infinigen::MakeServerCredentials({absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                                        absl::GetFlag(FLAGS_tls_client_ca)});
  if (!credentials.ok()) {
    std::cerr << "infinigen-kvstore: " << credentials.status().message() << "\n";
    return 2;
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), *credentials, &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(infinigen::kMaxKvMessageBytes));
  builder.SetMaxSendMessageSize(static_cast<int>(infinigen::kMaxKvMessageBytes));
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::cerr << "infinigen-kvstore: cannot listen on " << absl::GetFlag(FLAGS_listen) << "\n";
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
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::seconds(absl::GetFlag(FLAGS_drain_seconds)));
  stop.Notify();
  reaper.join();
#if INFINIGEN_HAVE_UCX
  ucx.reset();
#endif
  metrics.reset();
  std::cout << "infinigen-kvstore: stopped" << std::endl;
  return 0;
}
