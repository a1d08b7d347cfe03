// A decode step allocates nothing after warm-up (STYLE.md: hot paths allocate nothing): over 32
// decode steps of a batch that grows from 1 to 4 sequences and shrinks again, with InfiniGen,
// the window and dense attention mixed in the batch, neither the host (every operator new in
// this process, counted while a step runs) nor the backend (Allocate) is asked for memory once
// the same pattern has run before with other sequences. Sequences are opened (cache and policy
// state sized for their whole length) between steps, as the engine admits them.
// Three setups: the CPU backend over its resident cache; the CPU backend over the KV store
// (in-process: the all-in-one server's transport); and a backend the host cannot read (a GPU's
// path, on the CPU) over the store, InfiniGen choosing rows there and the rows of its last
// prefetches kept between steps (row reuse). All three are held to zero,
// the store's side of the gathers and appends included. (The queued transports, gRPC, shm
// and UCX, still copy each append's rows and each gather's items into their queue.)
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/infinigen/infinigen_policy.h"
#include "gpu_worker/infinigen/prepare.h"
#include "gpu_worker/infinigen/selection_config.h"
#include "gpu_worker/infinigen/sidecar.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "gpu_worker/kv/store_kv_cache.h"
#include "tests/support/device_like_backend.h"
#include "tests/support/fixture_model.h"
#include "tests/support/in_process_store.h"
#include "tests/support/test_paths.h"

namespace {

std::atomic<bool> counting{false};
std::atomic<int64_t> host_allocations{0};

void* CountedOrNull(size_t bytes) noexcept {
  if (counting.load(std::memory_order_relaxed)) host_allocations.fetch_add(1);
  return std::malloc(bytes == 0 ? 1 : bytes);
}

void* Counted(size_t bytes) {
  void* p = CountedOrNull(bytes);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

}  // namespace

// Every form that the replaced deletes free (the nothrow ones too: std::stable_sort's buffer,
// which an allocator that checks pairs, such as ASan's, saw freed by the wrong function).
void* operator new(size_t bytes) { return Counted(bytes); }
void* operator new[](size_t bytes) { return Counted(bytes); }
void* operator new(size_t bytes, const std::nothrow_t&) noexcept { return CountedOrNull(bytes); }
void* operator new[](size_t bytes, const std::nothrow_t&) noexcept { return CountedOrNull(bytes); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }

namespace infinigen {
namespace {

struct Running {
  SequenceId seq;
  std::vector<int32_t> tokens;
  int64_t decoded = 0;
  std::unique_ptr<KvSelectionPolicy> policy;
};

enum class Path { kResident, kStore, kDeviceStore };

class DecodeStepAllocations : public ::testing::TestWithParam<Path> {};

TEST_P(DecodeStepAllocations, NoneAfterWarmUpWhileTheBatchGrowsAndShrinks) {
  auto ckpt = Checkpoint::Open(testing::FixturePath("hf/llama31_gqa"));
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const Path setup = GetParam();
  std::unique_ptr<CpuBackend> owned = setup == Path::kDeviceStore
                                          ? std::make_unique<testing::DeviceLikeCpuBackend>()
                                          : std::make_unique<CpuBackend>();
  CpuBackend& backend = *owned;
  auto model = Model::Load(**ckpt, backend);
  ASSERT_TRUE(model.ok()) << model.status();
  Model& m = **model;
  PrepareOptions po;
  po.ratio = 0.5f;
  po.chunk_tokens = 40;
  auto sidecar =
      PrepareInfinigen(m, **ckpt, testing::RandomTokens(96, m.config().vocab_size, 5), po);
  ASSERT_TRUE(sidecar.ok()) << sidecar.status();
  ASSERT_TRUE(AttachSidecar(m, **ckpt, *sidecar).ok());
  std::shared_ptr<const PartialSkewOnBackend> skew;
  if (setup == Path::kDeviceStore) {
    auto uploaded = UploadPartialSkew(*sidecar, backend);
    ASSERT_TRUE(uploaded.ok()) << uploaded.status();
    skew = *uploaded;
  }
  std::unique_ptr<testing::InProcessStore> store;
  std::unique_ptr<KvCache> owned_cache;
  if (setup == Path::kResident) {
    owned_cache = std::make_unique<BackendKvCache>(backend, m.kv_shape());
  } else {
    store = std::make_unique<testing::InProcessStore>();
    ASSERT_NE(store->client, nullptr);
    StoreKvCacheOptions options;
    options.device_reads_mapped_rows = true;
    // Row reuse where the device gathers (each sequence's kept rows sized when it opens), planned
    // there as the worker does (the decode-only steps read no choice on the host).
    options.reuse_rows = [](int64_t capacity) { return capacity + 1; };
    options.plan_on_device = true;
    owned_cache = std::make_unique<StoreKvCache>(backend, m.kv_shape(), *store->client, options);
  }
  KvCache& cache = *owned_cache;
  DecodeStep step(m, cache);
  const int64_t vocab = m.config().vocab_size;
  std::vector<float> logits;

  // One round: sequences a, a+1, a+2, a+3 join at steps 0, 4, 8, 12 (their prompts prefilled
  // as they join) and leave after 20 decode steps each: 32 decode steps of 1, 2, 3, 4, 3, 2, 1.
  auto round = [&](SequenceId first, bool count) {
    std::vector<Running> running;
    int64_t decode_steps = 0;
    for (int t = 0; t < 32; ++t) {
      if (t % 4 == 0 && t < 16) {
        Running r;
        r.seq = first + t / 4;
        r.tokens = testing::RandomTokens(40 + 3 * (t / 4), vocab, static_cast<unsigned>(r.seq));
        SelectionConfig config;
        config.policy = t / 4 == 1 ? PolicyKind::kWindow : PolicyKind::kInfinigen;
        config.dense_layers = 1;
        config.budget_fraction = 0.3;
        if (t / 4 != 3) {
          auto p = MakeSelectionPolicy(config, m.config(), &*sidecar, skew);
          ASSERT_TRUE(p.ok()) << p.status();
          r.policy = std::move(*p);
        }
        const int64_t total = static_cast<int64_t>(r.tokens.size()) + 20;
        ASSERT_TRUE(cache.Open(r.seq, total).ok());
        if (r.policy != nullptr) r.policy->Open(r.seq, total);
        ForwardChunk c{r.seq, 0, r.tokens, false, r.policy.get()};
        logits.resize(vocab);
        ASSERT_TRUE(step.Forward({&c, 1}, logits).ok());
        r.tokens.push_back(0);
        running.push_back(std::move(r));
      }
      std::vector<ForwardChunk> batch;
      batch.reserve(8);
      for (Running& r : running) {
        batch.push_back({r.seq, static_cast<int64_t>(r.tokens.size()) - 1,
                         std::span<const int32_t>(&r.tokens.back(), 1), false, r.policy.get()});
      }
      if (batch.empty()) break;
      logits.resize(8 * vocab);
      const int64_t host_before = host_allocations.load(),
                    backend_before = backend.counters().allocations;
      counting = count;
      const absl::Status st = step.Forward(batch, logits);
      counting = false;
      ASSERT_TRUE(st.ok()) << st;
      ++decode_steps;
      if (count) {
        EXPECT_EQ(host_allocations.load() - host_before, 0)
            << "host allocations in decode step " << t << " (batch of " << batch.size() << ")";
        EXPECT_EQ(backend.counters().allocations - backend_before, 0)
            << "backend allocations in decode step " << t << " (batch of " << batch.size() << ")";
      }
      for (size_t b = 0; b < running.size(); ++b) {
        const float* row = logits.data() + b * vocab;
        running[b].tokens.back() = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
        running[b].tokens.push_back(0);
        ++running[b].decoded;
      }
      for (auto it = running.begin(); it != running.end();) {
        if (it->decoded < 20) {
          ++it;
          continue;
        }
        cache.Close(it->seq);
        if (it->policy != nullptr) it->policy->Release(it->seq);
        it = running.erase(it);
      }
    }
    if (count) {
      EXPECT_EQ(decode_steps, 32);
    }
  };
  round(100, false);  // warm-up: workspaces and scratch reach their sizes
  round(200, true);
}

INSTANTIATE_TEST_SUITE_P(Setups, DecodeStepAllocations,
                         ::testing::Values(Path::kResident, Path::kStore, Path::kDeviceStore),
                         [](const ::testing::TestParamInfo<Path>& info) {
                           return std::string(info.param == Path::kResident ? "CpuResident"
                                              : info.param == Path::kStore  ? "CpuOverTheStore"
                                                                            : "DeviceOverTheStore");
                         });

}  // namespace
}  // namespace infinigen
