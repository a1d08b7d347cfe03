// kv_device_gather_bench: the bandwidth of a decode layer's gather of chosen K/V rows from the
// KV store into the device, against the device's host-to-device bandwidth: a component
// micro-benchmark of the product's own path (#22's target: the gather at least 80% of the
// measured host-to-device bandwidth). The rows go through StoreKvCache as a GPU worker reads
// them over a collocated store (in-process here, shm in a pod: the same arena mapped): the
// batch's prefetches of one layer submitted together (BeginPrefetches, Prefetch,
// SubmitPrefetches), the store answering their block tables, the device reading the rows
// straight from the registered arena by slot (Backend::GatherBlockRows), then Fetch and the
// backend's wait. The baseline is one copy of as many bytes from pinned host memory
// (cudaMemcpyAsync), the best a host-to-device transfer does on this machine.
//
// usage: kv_device_gather_bench [--device cuda|device-like] [--tokens 32768] [--batch 1]
//            [--fractions 0.05,0.1,0.2,1] [--reps 20]
// Llama-3.1-8B's K/V shape (8 KV heads, head_dim 128, bf16: 256-byte rows). Each sequence
// holds --tokens rows; each rep chooses fraction x tokens distinct rows per KV head at random
// (1: every row, in order: a full fetch). One markdown row per fraction: rows per head, MiB
// moved per layer (K and V of every sequence), the gather's median time and GB/s, the pinned
// copy's median GB/s for as many bytes, and their ratio. The gathered rows are checked against
// what was stored before any time is taken. --device device-like runs it on the tests' CPU
// stand-in of a device (no GPU: a check that the path works, not a bandwidth).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "gpu_worker/kv/store_kv_cache.h"
#include "gpu_worker/model/loaded_model.h"
#include "kv_store/client/kv_store_client.h"
#include "kv_store/kv_store.h"
#include "tests/support/device_like_backend.h"

#if INFINIGEN_BENCH_CUDA
#include <cuda_runtime.h>
#endif

namespace infinigen {
namespace {

constexpr int kKvHeads = 8, kHeadDim = 128;

// The stored value of element d of token t's K (v = 0) or V (v = 1) row of KV head g: a bf16
// bit pattern of a finite number, so that any misplaced row shows.
uint16_t Stored(int64_t t, int g, int d, int v) {
  uint32_t h = static_cast<uint32_t>(t) * 2654435761u ^
               static_cast<uint32_t>(g * 131 + d) * 40503u ^ static_cast<uint32_t>(v) * 0x9e3779b9u;
  h ^= h >> 15;
  return static_cast<uint16_t>(h & 0x3fff);
}

double MedianMs(std::vector<double> t) {
  std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
  return t[t.size() / 2];
}

// The median time (ms) of copying `bytes` from pinned host memory to the device; host memcpy
// time on the CPU stand-in.
absl::StatusOr<double> PinnedCopyMs(bool cuda, size_t bytes, int reps) {
  std::vector<double> ms;
#if INFINIGEN_BENCH_CUDA
  if (cuda) {
    void *host = nullptr, *device = nullptr;
    cudaStream_t stream = nullptr;
    if (cudaMallocHost(&host, bytes) != cudaSuccess || cudaMalloc(&device, bytes) != cudaSuccess ||
        cudaStreamCreate(&stream) != cudaSuccess) {
      return absl::ResourceExhaustedError("no pinned or device memory for the baseline");
    }
    std::memset(host, 1, bytes);
    for (int r = 0; r < reps + 2; ++r) {
      const auto start = std::chrono::steady_clock::now();
      cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream);
      if (cudaStreamSynchronize(stream) != cudaSuccess) {
        return absl::InternalError("the baseline copy failed");
      }
      const auto end = std::chrono::steady_clock::now();
      if (r >= 2) ms.push_back(std::chrono::duration<double, std::milli>(end - start).count());
    }
    cudaStreamDestroy(stream);
    cudaFree(device);
    cudaFreeHost(host);
    return MedianMs(ms);
  }
#endif
  if (cuda) return absl::FailedPreconditionError("built without CUDA");
  std::vector<uint8_t> from(bytes, 1), to(bytes);
  for (int r = 0; r < reps + 2; ++r) {
    const auto start = std::chrono::steady_clock::now();
    std::memcpy(to.data(), from.data(), bytes);
    const auto end = std::chrono::steady_clock::now();
    if (r >= 2) ms.push_back(std::chrono::duration<double, std::milli>(end - start).count());
  }
  return MedianMs(ms);
}

struct Options {
  std::string device = "cuda";
  int64_t tokens = 32768, batch = 1;
  std::vector<double> fractions = {0.05, 0.1, 0.2, 1.0};
  int reps = 20;
};

absl::Status Run(const Options& o) {
  std::unique_ptr<Backend> backend;
  if (o.device == "device-like") {
    backend = std::make_unique<testing::DeviceLikeCpuBackend>();
  } else {
    BackendSpec spec;
    spec.device = o.device;
    IG_ASSIGN_OR_RETURN(backend, spec.Create());
  }
  const KvCacheShape shape{/*num_layers=*/2, kKvHeads, kHeadDim, DType::kBF16};
  const size_t row_bytes = kHeadDim * sizeof(uint16_t);
  KvStoreConfig sc;
  sc.capacity_bytes =
      static_cast<size_t>(o.batch * o.tokens) * shape.BytesPerToken() * 5 / 4 + (size_t{64} << 20);
  sc.shared_memory = false;
  IG_ASSIGN_OR_RETURN(std::unique_ptr<KvStore> store, KvStore::Create(sc));
  KvClientConfig cc;
  cc.transport = KvClientConfig::Transport::kInProcess;
  cc.store = store.get();
  IG_ASSIGN_OR_RETURN(std::unique_ptr<KvStoreClient> client, MakeKvStoreClient(cc));
  StoreKvCacheOptions options;  // as the worker sets them on a GPU, without row reuse
  options.device_reads_mapped_rows = true;
  StoreKvCache cache(*backend, shape, *client, options);
  if (!cache.device_gathers()) {
    return absl::FailedPreconditionError("the device does not gather from the store's arena");
  }

  // Every sequence's rows of layer 0 (layer 1 stays empty), appended from device memory.
  const int64_t chunk = 4096, cols = int64_t{kKvHeads} * kHeadDim;
  IG_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> k_rows, backend->Allocate(chunk * cols * 2));
  IG_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> v_rows, backend->Allocate(chunk * cols * 2));
  std::vector<uint16_t> host_k(static_cast<size_t>(chunk * cols)), host_v(host_k.size());
  for (SequenceId seq = 1; seq <= o.batch; ++seq) {
    IG_RETURN_IF_ERROR(cache.Open(seq, o.tokens));
    for (int64_t start = 0; start < o.tokens; start += chunk) {
      const int64_t n = std::min(chunk, o.tokens - start);
      for (int64_t t = 0; t < n; ++t) {
        for (int g = 0; g < kKvHeads; ++g) {
          for (int d = 0; d < kHeadDim; ++d) {
            host_k[t * cols + g * kHeadDim + d] = Stored(start + t, g, d, 0);
            host_v[t * cols + g * kHeadDim + d] = Stored(start + t, g, d, 1);
          }
        }
      }
      IG_RETURN_IF_ERROR(backend->CopyToDevice(host_k.data(), k_rows->data(), n * cols * 2));
      IG_RETURN_IF_ERROR(backend->CopyToDevice(host_v.data(), v_rows->data(), n * cols * 2));
      IG_RETURN_IF_ERROR(cache.Append(seq, 0, start,
                                      MatView{k_rows->data(), DType::kBF16, n, cols, cols},
                                      MatView{v_rows->data(), DType::kBF16, n, cols, cols}));
    }
  }
  IG_RETURN_IF_ERROR(client->Flush(absl::Now() + absl::Seconds(60)));

  std::printf("%s, %lld tokens a sequence, batch %lld, %d reps\n", o.device.c_str(),
              static_cast<long long>(o.tokens), static_cast<long long>(o.batch), o.reps);
  std::printf(
      "| rows per KV head | MiB per layer | gather (ms) | gather GB/s | pinned copy GB/s | "
      "gather / pinned copy |\n|---:|---:|---:|---:|---:|---:|\n");
  std::mt19937 rng(7);
  std::vector<int32_t> every(static_cast<size_t>(o.tokens));
  std::iota(every.begin(), every.end(), 0);
  for (double fraction : o.fractions) {
    const int64_t count =
        std::clamp<int64_t>(static_cast<int64_t>(fraction * o.tokens), 1, o.tokens);
    // Each rep's lists, [batch][kv heads, count], made before any time is taken.
    auto choose = [&]() {
      std::vector<std::vector<int32_t>> lists(static_cast<size_t>(o.batch));
      for (auto& list : lists) {
        for (int g = 0; g < kKvHeads; ++g) {
          if (count == o.tokens) {
            list.insert(list.end(), every.begin(), every.end());
            continue;
          }
          std::vector<int32_t> pool = every;
          for (int64_t j = 0; j < count; ++j) {
            std::swap(pool[j], pool[j + rng() % (o.tokens - j)]);
          }
          list.insert(list.end(), pool.begin(), pool.begin() + count);
        }
      }
      return lists;
    };
    std::vector<std::vector<std::vector<int32_t>>> reps;
    for (int r = 0; r < o.reps + 2; ++r) reps.push_back(choose());
    std::vector<double> ms;
    std::vector<KvLayerView> views(static_cast<size_t>(o.batch));
    for (int r = 0; r < o.reps + 2; ++r) {
      IG_RETURN_IF_ERROR(backend->Synchronize());
      const auto start = std::chrono::steady_clock::now();
      cache.BeginPrefetches();
      for (SequenceId seq = 1; seq <= o.batch; ++seq) {
        IG_RETURN_IF_ERROR(cache.Prefetch(seq, 0, reps[r][seq - 1].data(), count));
      }
      cache.SubmitPrefetches();
      for (SequenceId seq = 1; seq <= o.batch; ++seq) {
        IG_ASSIGN_OR_RETURN(views[seq - 1], cache.Fetch(seq, 0));
      }
      IG_RETURN_IF_ERROR(backend->Synchronize());
      const auto end = std::chrono::steady_clock::now();
      if (r >= 2) ms.push_back(std::chrono::duration<double, std::milli>(end - start).count());
      if (r == 0) {  // the rows are the ones stored (checked before any time counts)
        std::vector<uint16_t> got(static_cast<size_t>(count * kHeadDim));
        for (SequenceId seq = 1; seq <= o.batch; ++seq) {
          for (int g = 0; g < kKvHeads; ++g) {
            for (int v = 0; v < 2; ++v) {
              const MatView m =
                  (v == 0 ? views[seq - 1].k : views[seq - 1].v).Head(g, 0, count, kHeadDim);
              if (m.stride != kHeadDim) return absl::InternalError("rows not packed");
              IG_RETURN_IF_ERROR(backend->CopyToHost(m.data, got.data(), got.size() * 2));
              for (int64_t j = 0; j < count; ++j) {
                const int32_t t = reps[r][seq - 1][g * count + j];
                for (int d = 0; d < kHeadDim; ++d) {
                  if (got[j * kHeadDim + d] != Stored(t, g, d, v)) {
                    return absl::InternalError(absl::StrCat("sequence ", seq, " head ", g, " row ",
                                                            j, " (token ", t,
                                                            ") is not what was stored"));
                  }
                }
              }
            }
          }
        }
      }
    }
    const size_t bytes = static_cast<size_t>(o.batch * 2 * kKvHeads * count) * row_bytes;
    const double gather_ms = MedianMs(ms);
    IG_ASSIGN_OR_RETURN(const double copy_ms, PinnedCopyMs(o.device == "cuda", bytes, o.reps));
    const double gather_gbs = static_cast<double>(bytes) / (gather_ms * 1e6);
    const double copy_gbs = static_cast<double>(bytes) / (copy_ms * 1e6);
    std::printf("| %lld | %.2f | %.3f | %.1f | %.1f | %.2f |\n", static_cast<long long>(count),
                static_cast<double>(bytes) / (1 << 20), gather_ms, gather_gbs, copy_gbs,
                gather_gbs / copy_gbs);
    std::fflush(stdout);
  }
  for (SequenceId seq = 1; seq <= o.batch; ++seq) cache.Close(seq);
  return absl::OkStatus();
}

}  // namespace
}  // namespace infinigen

int main(int argc, char** argv) {
  infinigen::Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    bool ok = true;
    if (k == "--device") {
      o.device = v;
      ok = v == "cuda" || v == "device-like";
    } else if (k == "--tokens") {
      ok = absl::SimpleAtoi(v, &o.tokens) && o.tokens > 0;
    } else if (k == "--batch") {
      ok = absl::SimpleAtoi(v, &o.batch) && o.batch > 0;
    } else if (k == "--reps") {
      ok = absl::SimpleAtoi(v, &o.reps) && o.reps > 0;
    } else if (k == "--fractions") {
      o.fractions.clear();
      for (absl::string_view f : absl::StrSplit(v, ',')) {
        double x = 0;
        ok = ok && absl::SimpleAtod(f, &x) && x > 0 && x <= 1;
        o.fractions.push_back(x);
      }
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "kv_device_gather_bench: bad flag %s %s\n", k.c_str(), v.c_str());
      return 2;
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "kv_device_gather_bench: flags come in pairs\n");
    return 2;
  }
  const absl::Status st = infinigen::Run(o);
  if (!st.ok()) {
    std::fprintf(stderr, "kv_device_gather_bench: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
