// The machinery every KvStoreClient transport shares: one ordered work queue on a background
// thread (write-behind appends, asynchronous gathers, and synchronous calls that must not
// overtake them), the first append error kept for Flush, and a lease-renewal thread. A
// transport implements the Do* calls, which run on the queue thread.
#pragma once

#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "kv_store/client/kv_store_client.h"

namespace infinigen {

class QueuedKvClient : public KvStoreClient {
 public:
  ~QueuedKvClient() override;

  absl::Status Open(StoreSequenceId seq, const SequenceSpec& spec) final;
  absl::Status Close(StoreSequenceId seq) final;
  void AppendAsync(StoreSequenceId seq, int layer, int64_t start, int64_t n,
                   std::vector<uint8_t> k, std::vector<uint8_t> v) final;
  absl::Status Flush(absl::Time deadline) final;
  std::unique_ptr<GatherTicket> GatherAsync(std::vector<ClientGatherItem> items) final;
  absl::StatusOr<KvStoreStats> Stats() final;

 protected:
  explicit QueuedKvClient(const KvClientConfig& config);
  // Starts the queue and renewal threads; call at the end of the subclass constructor.
  void Start();
  // Stops the threads; call at the start of the subclass destructor.
  void Stop();

  virtual absl::Status DoOpen(StoreSequenceId seq, const SequenceSpec& spec) = 0;
  virtual absl::Status DoClose(StoreSequenceId seq) = 0;
  virtual absl::Status DoAppend(StoreSequenceId seq, int layer, int64_t start, int64_t n,
                                const std::vector<uint8_t>& k, const std::vector<uint8_t>& v) = 0;
  virtual absl::Status DoGather(const std::vector<ClientGatherItem>& items) = 0;
  virtual absl::StatusOr<KvStoreStats> DoStats() = 0;
  virtual absl::Status DoRenew() = 0;

  const KvClientConfig config_;

 private:
  // Runs `fn` on the queue thread after everything queued before it; waits up to `deadline`.
  absl::Status RunSync(std::function<absl::Status()> fn, absl::Time deadline);
  void Enqueue(std::function<void()> fn);
  void QueueLoop();
  void RenewLoop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status append_error_ ABSL_GUARDED_BY(mu_);
  std::thread queue_thread_;
  std::thread renew_thread_;
  absl::Notification stop_renew_;
};

}  // namespace infinigen
