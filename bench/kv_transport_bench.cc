// Per-layer gather through each KV transport (in-process, shm, gRPC) for typical per-layer
// sizes (0.5-4 MB: 8 KV heads x 128 dims x bf16, 128-1024 rows per head), latency p50/p99 and
// throughput, against a plain memcpy of the same bytes; plus the store's memory overhead per
// stored token beyond the K/V bytes. One JSON line per case, then a markdown table.
//
// --batch B splits each gather into B items of equal size (a batched prefetch of B sequences'
// rows; the total stays 0.5-4 MB).
//
// --rows LIST sets the rows gathered per KV head (default 128,256,512,1024); small counts show a
// transport's fixed cost per gather.
//
// With UCX, "ucx-grpc-appends" is the UCX transport with its appends over gRPC (the store told
// not to take them over UCX): the fill's baseline.
//
// usage: kv_transport_bench [--iterations 200] [--transports in-process,shm,grpc,ucx] [--batch 1]
//                           [--rows 128,256,512,1024]
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <span>

#include "absl/algorithm/container.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kv_store/client/kv_store_client.h"
#include "kv_store/service/kvstore_service.h"
#if INFINIGEN_HAVE_UCX
#include "kv_store/ucx/ucx_data_plane.h"
#endif

namespace {

using namespace infinigen;  // NOLINT

constexpr int kHeads = 8, kDim = 128;
constexpr int64_t kRowBytes = kDim * 2;
constexpr int64_t kStored = 16384;  // tokens in the layer

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

}  // namespace

int main(int argc, char** argv) {
  int iterations = 200;
  std::string only;  // comma-separated transports to run; empty: all
  int batch = 1;
  std::vector<int64_t> rows_per_head = {128, 256, 512, 1024};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--iterations") {
      iterations = std::atoi(argv[i + 1]);
    } else if (flag == "--transports") {
      only = argv[i + 1];
    } else if (flag == "--batch") {
      batch = std::max(1, std::atoi(argv[i + 1]));
    } else if (flag == "--rows") {
      rows_per_head.clear();
      for (absl::string_view r : absl::StrSplit(argv[i + 1], ',')) {
        int64_t n = 0;
        if (!absl::SimpleAtoi(r, &n) || n < 1 || n > kStored) {
          std::fprintf(stderr, "--rows takes counts in [1, %ld], got %s\n", kStored, argv[i + 1]);
          return 2;
        }
        rows_per_head.push_back(n);
      }
    } else {
      std::fprintf(stderr,
                   "unknown flag %s (expected --iterations N, --transports LIST, --batch B, "
                   "--rows LIST)\n",
                   flag.c_str());
      return 2;
    }
  }
  KvStoreConfig c;
  c.capacity_bytes = size_t{512} << 20;
  c.block_tokens = 64;
  c.max_row_bytes = kRowBytes;
  c.huge_pages = false;
  auto store = std::move(*KvStore::Create(c));
  KvStoreService service(*store);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(256 << 20);
  builder.SetMaxSendMessageSize(256 << 20);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  std::vector<const char*> transports = {"in-process", "shm", "grpc"};
#if INFINIGEN_HAVE_UCX
  auto ucx = std::move(*UcxDataServer::Start(
      *store, 0, [&service](std::span<const uint8_t> request, std::span<const uint8_t> rows) {
        return service.AppendBatchWithRows(request, rows);
      }));
  // "ucx-grpc-appends": gathers over UCX, appends over gRPC (as before the store took them over
  // UCX), the baseline of the fill.
  transports.push_back("ucx-grpc-appends");
  transports.push_back("ucx");
#endif

  SequenceSpec spec;
  spec.num_layers = 1;
  spec.num_kv_heads = kHeads;
  spec.head_dim = kDim;
  spec.dtype = DType::kBF16;
  (void)store->Open(1, spec, absl::Now());
  std::vector<uint8_t> rows(1024 * kHeads * kRowBytes, 0x3c);
  for (int64_t t = 0; t < kStored; t += 1024) {
    (void)store->Append(1, 0, t, 1024, rows.data(), rows.data(), rows.size());
  }
  // Memory overhead per stored token beyond K/V: blocks are full for this length, so what is
  // left is the block tables (4 bytes per block per head for K and V).
  const KvStoreStats st = store->Stats();
  const double kv_bytes = 2.0 * kStored * kHeads * kRowBytes;
  const double table_bytes = 2.0 * kHeads * (kStored * kRowBytes / c.block_tokens / kRowBytes) * 4;
  std::printf(
      "{\"memory\": {\"tokens\": %ld, \"kv_bytes_per_token\": %.1f, "
      "\"arena_bytes_per_token\": %.1f, \"block_table_bytes_per_token\": %.3f}}\n",
      kStored, kv_bytes / kStored, double(st.bytes_used) / kStored, table_bytes / kStored);

  std::mt19937 rng(3);
  struct Row {
    std::string transport;
    double mb, p50_us, p99_us, gbps, memcpy_gbps;
  };
  std::vector<Row> table;
  StoreSequenceId seq = 1;
  for (const char* name : transports) {
    ++seq;
    if (!only.empty() && !absl::c_linear_search(absl::StrSplit(only, ','), name)) continue;
    KvClientConfig cc;
    const bool grpc_appends = std::string(name) == "ucx-grpc-appends";
    cc.transport = *ParseTransport(grpc_appends ? "ucx" : name);
#if INFINIGEN_HAVE_UCX
    service.set_ucx_port(ucx->port(), /*appends=*/!grpc_appends);
#endif
    cc.address = "127.0.0.1:" + std::to_string(port);
    cc.store = store.get();
    cc.renew_every = absl::ZeroDuration();
    cc.call_timeout = absl::Seconds(10);
    auto client = std::move(*MakeKvStoreClient(cc));
    // Each transport fills its own sequence through itself.
    if (auto st = client->Open(seq, spec); !st.ok()) {
      std::fprintf(stderr, "%s: %s\n", name, std::string(st.message()).c_str());
      return 1;
    }
    // The fill is timed too: a prompt's K/V on their way to the store (AppendAsync, Flush),
    // twice. Cold: into arena pages no sequence has held (the store's first prompts, each page
    // faulted in). Warm: into the blocks a closed sequence gave back (a running store's case).
    auto fill = [&](StoreSequenceId into) -> double {
      const auto fill_start = std::chrono::steady_clock::now();
      for (int64_t t = 0; t < kStored; t += 1024) client->AppendAsync(into, 0, t, 1024, rows, rows);
      if (auto st = client->Flush(absl::Now() + absl::Seconds(30)); !st.ok()) {
        std::fprintf(stderr, "%s: %s\n", name, std::string(st.message()).c_str());
        return -1;
      }
      const double fill_s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - fill_start).count();
      return 2.0 * kStored * kHeads * kRowBytes / 1e9 / fill_s;
    };
    const StoreSequenceId cold = seq + 1000;
    if (auto st = client->Open(cold, spec); !st.ok()) {
      std::fprintf(stderr, "%s: %s\n", name, std::string(st.message()).c_str());
      return 1;
    }
    const double cold_gbps = fill(cold);
    if (cold_gbps < 0 || !client->Close(cold).ok()) return 1;
    const double warm_gbps = fill(seq);
    if (warm_gbps < 0) return 1;
    // A decode step's appends: one token into each of 32 layers, then a Flush (what a gather
    // that needs them waits for): the round trip of a small batch.
    const StoreSequenceId step_seq = seq + 2000;
    SequenceSpec step_spec = spec;
    step_spec.num_layers = 32;
    if (auto st = client->Open(step_seq, step_spec); !st.ok()) {
      std::fprintf(stderr, "%s: %s\n", name, std::string(st.message()).c_str());
      return 1;
    }
    std::vector<double> step_us;
    const std::span<const uint8_t> one(rows.data(), kHeads * kRowBytes);
    for (int t = 0; t < 210; ++t) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int layer = 0; layer < 32; ++layer) client->AppendAsync(step_seq, layer, t, 1, one, one);
      if (auto st = client->Flush(absl::Now() + absl::Seconds(10)); !st.ok()) {
        std::fprintf(stderr, "%s: %s\n", name, std::string(st.message()).c_str());
        return 1;
      }
      const double dt =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      if (t >= 10) step_us.push_back(dt);
    }
    (void)client->Close(step_seq);
    std::printf(
        "{\"transport\":\"%s\",\"append_mb\":%.1f,\"append_gbps_cold\":%.3f,"
        "\"append_gbps\":%.3f,\"decode_step_append_us_p50\":%.1f,"
        "\"decode_step_append_us_p99\":%.1f}\n",
        name, 2.0 * kStored * kHeads * kRowBytes / 1e6, cold_gbps, warm_gbps,
        Percentile(step_us, 0.5), Percentile(step_us, 0.99));
    for (int64_t total_per_head : rows_per_head) {
      const int64_t per_head = std::max<int64_t>(1, total_per_head / batch);
      std::vector<int32_t> slots(kHeads * per_head * batch);
      for (auto& s : slots) s = static_cast<int32_t>(rng() % kStored);
      const int64_t bytes = 2 * slots.size() * kRowBytes;
      std::vector<uint8_t> k(bytes / 2), v(bytes / 2);
      std::vector<ClientGatherItem> items;
      const size_t item_rows = static_cast<size_t>(kHeads * per_head);
      for (int b = 0; b < batch; ++b) {
        items.push_back({seq, 0, per_head,
                         std::vector<int32_t>(slots.begin() + b * item_rows,
                                              slots.begin() + (b + 1) * item_rows),
                         k.data() + b * item_rows * kRowBytes,
                         v.data() + b * item_rows * kRowBytes});
      }
      std::vector<double> us;
      for (int i = 0; i < iterations + 10; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        auto ticket = client->GatherAsync(items);
        if (auto st = ticket->Wait(absl::Now() + absl::Seconds(30)); !st.ok()) {
          std::fprintf(stderr, "%s: %s\n", name, std::string(st.message()).c_str());
          return 1;
        }
        const double dt =
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                .count();
        if (i >= 10) us.push_back(dt);
      }
      std::vector<uint8_t> src(bytes, 1), dst(bytes);
      std::vector<double> mus;
      for (int i = 0; i < iterations; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        std::memcpy(dst.data(), src.data(), bytes);
        mus.push_back(
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                .count());
      }
      const double p50 = Percentile(us, 0.5), p99 = Percentile(us, 0.99);
      Row r{name, bytes / 1e6, p50, p99, bytes / p50 / 1e3, bytes / Percentile(mus, 0.5) / 1e3};
      std::printf(
          "{\"transport\": \"%s\", \"mb\": %.2f, \"p50_us\": %.1f, \"p99_us\": %.1f, "
          "\"gb_per_s\": %.2f, \"memcpy_gb_per_s\": %.2f, \"batch\": %d}\n",
          name, r.mb, r.p50_us, r.p99_us, r.gbps, r.memcpy_gbps, batch);
      table.push_back(r);
    }
  }
  std::printf(
      "\n| transport | gather MB | p50 us | p99 us | GB/s (p50) | memcpy GB/s | vs memcpy |\n"
      "|---|---:|---:|---:|---:|---:|---:|\n");
  for (const Row& r : table) {
    std::printf("| %s | %.2f | %.0f | %.0f | %.2f | %.2f | %.2fx |\n", r.transport.c_str(), r.mb,
                r.p50_us, r.p99_us, r.gbps, r.memcpy_gbps, r.gbps / r.memcpy_gbps);
  }
  server->Shutdown();
#if INFINIGEN_HAVE_UCX
  ucx.reset();
#endif
  return 0;
}
