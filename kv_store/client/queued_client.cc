#include "kv_store/client/queued_client.h"

#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"

namespace infinigen {
namespace {

struct TicketState {
  absl::Notification done;
  absl::Status status;
};

class QueuedTicket final : public GatherTicket {
 public:
  explicit QueuedTicket(std::shared_ptr<TicketState> state) : state_(std::move(state)) {}
  ~QueuedTicket() override {
    // The queue thread writes into the caller's buffers: never let them go before it is done.
    state_->done.WaitForNotification();
  }
  absl::Status Wait(absl::Time deadline) override {
    if (!state_->done.WaitForNotificationWithDeadline(deadline)) {
      return absl::DeadlineExceededError("gather did not finish before its deadline");
    }
    return state_->status;
  }
  bool Done() override { return state_->done.HasBeenNotified(); }

 private:
  std::shared_ptr<TicketState> state_;
};

}  // namespace

QueuedKvClient::QueuedKvClient(const KvClientConfig& config) : config_(config) {}

QueuedKvClient::~QueuedKvClient() { Stop(); }

void QueuedKvClient::Start() {
  queue_thread_ = std::thread([this] { QueueLoop(); });
  append_thread_ = std::thread([this] { AppendLoop(); });
  if (config_.renew_every > absl::ZeroDuration()) {
    renew_thread_ = std::thread([this] { RenewLoop(); });
  }
}

void QueuedKvClient::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (!stop_renew_.HasBeenNotified()) stop_renew_.Notify();
  if (renew_thread_.joinable()) renew_thread_.join();
  if (append_thread_.joinable()) append_thread_.join();
  if (queue_thread_.joinable()) queue_thread_.join();
}

void QueuedKvClient::Enqueue(uint64_t after_append, std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  queue_.push_back({after_append, std::move(fn)});
}

void QueuedKvClient::QueueLoop() {
  for (;;) {
    std::function<void()> fn;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, and everything queued has run
      const uint64_t after = queue_.front().after_append;
      appends_wanted_ = std::max(appends_wanted_, after);  // they stop lingering
      auto appended = [this, after]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return appends_done_ >= after || appends_stopped_;
      };
      mu_.Await(absl::Condition(&appended));
      fn = std::move(queue_.front().fn);
      queue_.pop_front();
    }
    fn();
  }
}

void QueuedKvClient::AppendLoop() {
  constexpr size_t kMaxBatchBytes = 32 << 20;
  for (;;) {
    std::vector<AppendJob> batch;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !appends_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (appends_.empty()) {  // stopping, and every append has run
        appends_stopped_ = true;
        return;
      }
      // Linger for company, unless someone waits for these appends or enough have piled up.
      auto send = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || appends_wanted_ > appends_done_ ||
               append_bytes_queued_ >= kMaxBatchBytes;
      };
      mu_.AwaitWithDeadline(absl::Condition(&send),
                            appends_.front().queued_at + config_.append_linger);
      // Those a gather or call waits for go first, alone: it does not wait for the appends
      // queued after them too (a prompt chunk's, megabytes, behind a decode step's rows).
      size_t most = appends_.size();
      if (appends_wanted_ > appends_done_) {
        most = std::min<size_t>(most, static_cast<size_t>(appends_wanted_ - appends_done_));
      }
      size_t bytes = 0;
      while (!appends_.empty() && batch.size() < most &&
             (batch.empty() || bytes < kMaxBatchBytes)) {
        bytes += appends_.front().bytes();
        batch.push_back(std::move(appends_.front()));
        appends_.pop_front();
      }
      append_bytes_queued_ -= bytes;
    }
    const std::vector<absl::Status> statuses = DoAppendBatch(batch);
    for (size_t i = 0; i < batch.size(); ++i) {
      if (i < statuses.size()) append_failures_.Record(batch[i].seq, batch[i].layer, statuses[i]);
    }
    absl::MutexLock lock(&mu_);
    for (const absl::Status& st : statuses) {
      if (!st.ok() && append_error_.ok()) append_error_ = st;
    }
    appends_done_ += batch.size();
  }
}

std::vector<absl::Status> QueuedKvClient::DoAppendBatch(const std::vector<AppendJob>& jobs) {
  std::vector<absl::Status> statuses;
  absl::flat_hash_map<StoreSequenceId, size_t> failed;  // sequence -> its failed append
  for (size_t i = 0; i < jobs.size(); ++i) {
    const AppendJob& j = jobs[i];
    if (auto it = failed.find(j.seq); it != failed.end()) {
      statuses.push_back(absl::FailedPreconditionError(
          absl::StrCat("not tried: an earlier append to sequence ", j.seq,
                       " failed: ", statuses[it->second].message())));
      continue;
    }
    statuses.push_back(DoAppend(j.seq, j.layer, j.start, j.n, j.k_rows(), j.v_rows(), j.slots));
    if (!statuses.back().ok()) failed.emplace(j.seq, i);
  }
  return statuses;
}

void QueuedKvClient::NoteClose(StoreSequenceId seq, const absl::Status& closed) {
  if (closed.ok() || absl::IsNotFound(closed)) {
    unclosed_.erase(seq);
  } else {
    unclosed_.insert(seq);
  }
}

void QueuedKvClient::NoteRelease(StoreSequenceId seq, const absl::Status& released) {
  if (released.ok() || absl::IsNotFound(released)) {
    unreleased_.erase(seq);
  } else {
    unreleased_.insert(seq);
  }
}

void QueuedKvClient::RenewLoop() {
  while (!stop_renew_.WaitForNotificationWithTimeout(config_.renew_every)) {
    // Renewal failures are not fatal: the next one may get through before the lease ends.
    RunSync(
        [this] {
          const std::vector<StoreSequenceId> retry(unclosed_.begin(), unclosed_.end());
          for (StoreSequenceId seq : retry) NoteClose(seq, DoClose(seq));
          const std::vector<StoreSequenceId> give_up(unreleased_.begin(), unreleased_.end());
          for (StoreSequenceId seq : give_up) NoteRelease(seq, DoRelease(seq));
          return DoRenew();
        },
        absl::Now() + config_.call_timeout)
        .IgnoreError();
  }
}

absl::Status QueuedKvClient::RunSync(std::function<absl::Status()> fn, absl::Time deadline,
                                     std::function<void(const absl::Status&)> if_abandoned) {
  struct Call {
    absl::Notification done;
    absl::Status status;
    bool finished = false;   // under mu_
    bool abandoned = false;  // under mu_
  };
  auto call = std::make_shared<Call>();
  uint64_t after;
  {
    absl::MutexLock lock(&mu_);
    after = appends_queued_;
  }
  Enqueue(after, [this, call, fn = std::move(fn), if_abandoned = std::move(if_abandoned)] {
    const absl::Status st = fn();
    bool abandoned;
    {
      absl::MutexLock lock(&mu_);
      call->status = st;
      call->finished = true;
      abandoned = call->abandoned;
    }
    if (abandoned && if_abandoned) if_abandoned(st);
    call->done.Notify();
  });
  if (call->done.WaitForNotificationWithDeadline(deadline)) return call->status;
  absl::MutexLock lock(&mu_);
  if (call->finished) return call->status;  // it finished just now: the caller gets its result
  call->abandoned = true;
  return absl::DeadlineExceededError("the KV store client queue did not drain in time");
}

absl::Status QueuedKvClient::Open(StoreSequenceId seq, const SequenceSpec& spec) {
  SequenceSpec s = spec;
  if (s.owner.empty()) s.owner = config_.owner;
  return RunSync(
      [this, seq, s] {
        absl::Status st = DoOpen(seq, s);
        if (st.ok()) {
          unclosed_.erase(seq);  // opened anew: wanted
          unreleased_.erase(seq);
          append_failures_.Forget(seq);
        }
        return st;
      },
      absl::Now() + 4 * config_.call_timeout,
      // Opened after the caller gave up on it: nobody will close it, and renewals would keep it.
      [this, seq](const absl::Status& opened) {
        if (opened.ok()) NoteClose(seq, DoClose(seq));
      });
}

absl::StatusOr<int64_t> QueuedKvClient::Attach(StoreSequenceId from, StoreSequenceId to,
                                               const SequenceSpec& spec, int64_t max_length) {
  return Transfer(from, to, spec, max_length, /*fork=*/false);
}

absl::StatusOr<int64_t> QueuedKvClient::Fork(StoreSequenceId from, StoreSequenceId to,
                                             const SequenceSpec& spec, int64_t length) {
  return Transfer(from, to, spec, length, /*fork=*/true);
}

absl::StatusOr<int64_t> QueuedKvClient::Transfer(StoreSequenceId from, StoreSequenceId to,
                                                 const SequenceSpec& spec, int64_t max_length,
                                                 bool fork) {
  SequenceSpec s = spec;
  if (s.owner.empty()) s.owner = config_.owner;
  // Shared: if the caller stops waiting, the call still runs (and sets it) on the queue thread.
  auto length = std::make_shared<int64_t>(0);
  absl::Status st = RunSync(
      [this, from, to, s, max_length, length, fork] {
        absl::StatusOr<int64_t> kept =
            fork ? DoFork(from, to, s, max_length) : DoAttach(from, to, s, max_length);
        if (!kept.ok()) return kept.status();
        *length = *kept;
        unclosed_.erase(to);
        unreleased_.erase(to);
        append_failures_.Forget(to);
        return absl::OkStatus();
      },
      absl::Now() + 4 * config_.call_timeout,
      // Taken over (or copied) after the caller gave up on it: nobody will close it.
      [this, to](const absl::Status& attached) {
        if (attached.ok()) NoteClose(to, DoClose(to));
      });
  if (!st.ok()) return st;
  return *length;
}

absl::Status QueuedKvClient::Release(StoreSequenceId seq) {
  absl::Status st = RunSync(
      [this, seq] {
        absl::Status released = DoRelease(seq);
        NoteRelease(seq, released);
        return released;
      },
      absl::Now() + 4 * config_.call_timeout,
      // Still tried after the caller gave up waiting: retried until it goes through.
      [this, seq](const absl::Status& released) { NoteRelease(seq, released); });
  append_failures_.Forget(seq);
  absl::MutexLock lock(&mu_);
  last_append_.erase(seq);
  return st;
}

absl::Status QueuedKvClient::Close(StoreSequenceId seq) {
  absl::Status st = RunSync(
      [this, seq] {
        absl::Status closed = DoClose(seq);
        NoteClose(seq, closed);
        return closed;
      },
      absl::Now() + 4 * config_.call_timeout);
  append_failures_.Forget(seq);
  absl::MutexLock lock(&mu_);
  last_append_.erase(seq);
  return st;
}

void QueuedKvClient::AppendAsync(StoreSequenceId seq, int layer, int64_t start, int64_t n,
                                 std::span<const uint8_t> k, std::span<const uint8_t> v,
                                 std::span<const int32_t> slots) {
  // The rows' one copy on this side, made before the lock (a prompt chunk's are megabytes):
  // into the transport's staging (shm), else into the queue.
  AppendJob job{
      seq, layer, start, n, {}, {}, absl::Now(), {slots.begin(), slots.end()}, StageRows(k, v)};
  if (!job.staged) {
    job.k.assign(k.begin(), k.end());
    job.v.assign(v.begin(), v.end());
  }
  absl::MutexLock lock(&mu_);
  const uint64_t number = ++appends_queued_;
  auto& last = last_append_[seq];
  if (layer >= 0 && static_cast<size_t>(layer) >= last.size()) last.resize(layer + 1, 0);
  if (layer >= 0) last[layer] = number;
  append_bytes_queued_ += k.size() + v.size();
  appends_.push_back(std::move(job));
}

absl::Status QueuedKvClient::Flush(absl::Time deadline) {
  absl::Status st = RunSync([] { return absl::OkStatus(); }, deadline);
  if (!st.ok()) return st;
  absl::MutexLock lock(&mu_);
  absl::Status error = append_error_;
  append_error_ = absl::OkStatus();
  return error;
}

std::shared_ptr<GatherTicket> QueuedKvClient::GatherAsync(std::span<const ClientGatherItem> span) {
  std::vector<ClientGatherItem> items(span.begin(), span.end());  // the queue thread's copy
  auto state = std::make_shared<TicketState>();
  uint64_t after = 0;  // the last append queued to a (sequence, layer) this gather reads
  {
    absl::MutexLock lock(&mu_);
    for (const ClientGatherItem& item : items) {
      auto it = last_append_.find(item.seq);
      if (it != last_append_.end() && item.layer >= 0 &&
          static_cast<size_t>(item.layer) < it->second.size()) {
        after = std::max(after, it->second[item.layer]);
      }
    }
  }
  Enqueue(after, [this, state, items = std::move(items)] {
    state->status = append_failures_.Explain(DoGather(items), items);
    state->done.Notify();
  });
  return std::make_shared<QueuedTicket>(state);
}

absl::StatusOr<KvStoreStats> QueuedKvClient::Stats() {
  // Shared, not on this stack: after a timeout the queued call still runs and writes it.
  auto stats = std::make_shared<KvStoreStats>();
  absl::Status st = RunSync(
      [this, stats] {
        auto s = DoStats();
        if (!s.ok()) return s.status();
        *stats = *s;
        return absl::OkStatus();
      },
      absl::Now() + 4 * config_.call_timeout);
  if (!st.ok()) return st;
  return *stats;
}

}  // namespace infinigen
