// The machinery every KvStoreClient transport shares: write-behind appends on their own thread
// (in order among themselves), a work queue on another thread for gathers and synchronous calls,
// the first append error kept for Flush and each sequence's first one for its gathers' errors
// (AppendFailures), and a lease-renewal thread, which also retries the Close (or Release) of
// sequences whose Close (Release) failed (the lease it renews would otherwise keep them for the
// client's whole life). A
// gather waits only for the appends to the (sequence, layer) pairs it reads that were queued before
// it, so a prefetch of rows stored in earlier steps never waits behind this step's appends;
// synchronous calls wait for every append queued before them. Appends linger (config.append_linger)
// so that a step's appends of every layer travel in one call: they go as soon as a gather or call
// waits for one of them (then those up to the last it waits for go alone, without the ones queued
// after), when enough bytes are queued, or when the oldest has waited the linger. A
// transport implements the Do* calls; DoAppend runs on the append thread, the others on the queue
// thread, so the two may run at the same time.
#pragma once

#include <deque>
#include <functional>
#include <span>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "kv_store/client/append_failures.h"
#include "kv_store/client/kv_store_client.h"
#include "kv_store/client/staging_ring.h"

namespace infinigen {

class QueuedKvClient : public KvStoreClient {
 public:
  ~QueuedKvClient() override;

  absl::Status Open(StoreSequenceId seq, const SequenceSpec& spec) final;
  absl::Status Close(StoreSequenceId seq) final;
  absl::Status Release(StoreSequenceId seq) final;
  absl::StatusOr<int64_t> Attach(StoreSequenceId from, StoreSequenceId to, const SequenceSpec& spec,
                                 int64_t max_length) final;
  absl::StatusOr<int64_t> Fork(StoreSequenceId from, StoreSequenceId to, const SequenceSpec& spec,
                               int64_t length) final;
  using KvStoreClient::AppendAsync;
  void AppendAsync(StoreSequenceId seq, int layer, int64_t start, int64_t n,
                   std::span<const uint8_t> k, std::span<const uint8_t> v,
                   std::span<const int32_t> slots) final;
  absl::Status Flush(absl::Time deadline) final;
  std::shared_ptr<GatherTicket> GatherAsync(std::span<const ClientGatherItem> items) final;
  absl::StatusOr<KvStoreStats> Stats() final;

 protected:
  explicit QueuedKvClient(const KvClientConfig& config);
  // Starts the queue and renewal threads; call at the end of the subclass constructor.
  void Start();
  // Stops the threads; call at the start of the subclass destructor.
  void Stop();

  virtual absl::Status DoOpen(StoreSequenceId seq, const SequenceSpec& spec) = 0;
  virtual absl::Status DoClose(StoreSequenceId seq) = 0;
  virtual absl::Status DoRelease(StoreSequenceId seq) = 0;
  virtual absl::StatusOr<int64_t> DoAttach(StoreSequenceId from, StoreSequenceId to,
                                           const SequenceSpec& spec, int64_t max_length) = 0;
  virtual absl::StatusOr<int64_t> DoFork(StoreSequenceId from, StoreSequenceId to,
                                         const SequenceSpec& spec, int64_t length) = 0;
  virtual absl::Status DoAppend(StoreSequenceId seq, int layer, int64_t start, int64_t n,
                                std::span<const uint8_t> k, std::span<const uint8_t> v,
                                std::span<const int32_t> slots) = 0;
  // The appends that piled up while the previous ones ran, in order; returns each one's status.
  // A failed append fails the later appends of its sequence (not tried: they could not be in
  // order) and no other. The default sends them one by one.
  struct AppendJob {
    StoreSequenceId seq;
    int layer;
    int64_t start, n;
    std::vector<uint8_t> k, v;  // the queue's copy of the rows, empty where they are staged
    absl::Time queued_at;
    std::vector<int32_t> slots;  // a KV pool's (AppendAsync)
    StagedRows staged;           // the rows where StageRows put them, if it did

    std::span<const uint8_t> k_rows() const { return staged ? staged.k() : k; }
    std::span<const uint8_t> v_rows() const { return staged ? staged.v() : v; }
    size_t bytes() const { return k_rows().size() + v_rows().size(); }
  };
  // Where AppendAsync may write an append's rows instead of into the queue (the caller's thread;
  // thread-safe): the shm transport's staging file, which the store copies from. Empty: the
  // queue copies them.
  virtual StagedRows StageRows(std::span<const uint8_t> k, std::span<const uint8_t> v) {
    return {};
  }
  virtual std::vector<absl::Status> DoAppendBatch(const std::vector<AppendJob>& jobs);
  virtual absl::Status DoGather(const std::vector<ClientGatherItem>& items) = 0;
  virtual absl::StatusOr<KvStoreStats> DoStats() = 0;
  virtual absl::Status DoRenew() = 0;

  const KvClientConfig config_;

 private:
  // Attach, or with `fork` Fork: `to` becomes this client's sequence.
  absl::StatusOr<int64_t> Transfer(StoreSequenceId from, StoreSequenceId to,
                                   const SequenceSpec& spec, int64_t length, bool fork);
  struct Job {
    uint64_t after_append;  // runs once appends 1 .. after_append are done
    std::function<void()> fn;
  };

  // Runs `fn` on the queue thread after everything queued before it, appends included; waits
  // up to `deadline`. If the caller stops waiting first, `if_abandoned` (when given) gets fn's
  // status on the queue thread once fn has run: the caller was told DEADLINE_EXCEEDED.
  absl::Status RunSync(std::function<absl::Status()> fn, absl::Time deadline,
                       std::function<void(const absl::Status&)> if_abandoned = nullptr);
  // Queue thread: remembers `seq` for a retried Close unless `closed` says it is gone.
  void NoteClose(StoreSequenceId seq, const absl::Status& closed);
  // Queue thread: remembers `seq` for a retried Release unless `released` says it is done.
  void NoteRelease(StoreSequenceId seq, const absl::Status& released);
  void Enqueue(uint64_t after_append, std::function<void()> fn);
  void QueueLoop();
  void AppendLoop();
  void RenewLoop();

  absl::Mutex mu_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  std::deque<AppendJob> appends_ ABSL_GUARDED_BY(mu_);
  uint64_t appends_queued_ ABSL_GUARDED_BY(mu_) = 0;  // numbers appends 1, 2, ...
  uint64_t appends_done_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t appends_wanted_ ABSL_GUARDED_BY(mu_) = 0;  // the last append a queued job waits for
  size_t append_bytes_queued_ ABSL_GUARDED_BY(mu_) = 0;
  bool appends_stopped_ ABSL_GUARDED_BY(mu_) = false;
  // seq -> per layer, the number of the last append queued to it.
  absl::flat_hash_map<StoreSequenceId, std::vector<uint64_t>> last_append_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status append_error_ ABSL_GUARDED_BY(mu_);  // the first since the last Flush
  AppendFailures append_failures_;
  // Sequences whose Close failed (or whose Open the caller gave up on after it went through):
  // closed again before each renewal. Read and written on the queue thread only.
  absl::flat_hash_set<StoreSequenceId> unclosed_;
  // Sequences whose Release failed: released again before each renewal. Queue thread only.
  absl::flat_hash_set<StoreSequenceId> unreleased_;
  std::thread queue_thread_;
  std::thread append_thread_;
  std::thread renew_thread_;
  absl::Notification stop_renew_;
};

}  // namespace infinigen
