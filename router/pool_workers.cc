#include "router/pool_workers.h"

#include <algorithm>
#include <utility>

namespace infinigen {
namespace {

namespace wv1 = worker::v1;

class PoolWorkerCall final : public WorkerCall {
 public:
  PoolWorkerCall(std::shared_ptr<PooledWorker> worker, StallWatchdog& watchdog,
                 grpc::ServerContext& context, const wv1::GenerateRequest& request,
                 int64_t expected_tokens)
      : worker_(std::move(worker)),
        context_(grpc::ClientContext::FromServerContext(context)),
        expected_(expected_tokens) {
    worker_->AddOutstanding(expected_);
    reader_ = worker_->stub().Generate(context_.get(), request);
    watch_ = std::make_unique<StallWatchdog::Watch>(watchdog, *context_, *worker_);
  }
  ~PoolWorkerCall() override {
    if (watch_ != nullptr) {  // Finish was not called: end the call before the context goes
      context_->TryCancel();
      static_cast<void>(Finish());
    }
    worker_->AddOutstanding(-expected_);
  }

  bool Read(wv1::GenerateResponse* message) override {
    if (!reader_->Read(message)) return false;
    watch_->Progress();
    const int64_t n = std::min<int64_t>(message->token_ids_size(), expected_);
    worker_->AddOutstanding(-n);
    expected_ -= n;
    return true;
  }
  void Cancel() override { context_->TryCancel(); }
  absl::Status Finish() override {
    const grpc::Status s = reader_->Finish();
    stalled_ = watch_->stalled();
    watch_.reset();
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  }
  bool stalled() const override { return stalled_; }

 private:
  std::shared_ptr<PooledWorker> worker_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReader<wv1::GenerateResponse>> reader_;
  std::unique_ptr<StallWatchdog::Watch> watch_;  // destroyed before the context
  int64_t expected_;                             // tokens still counted as the worker's load
  bool stalled_ = false;
};

}  // namespace

std::string PoolWorkers::Pick(absl::string_view session_id,
                              const std::vector<std::string>& excluded) {
  std::vector<const PooledWorker*> exclude;
  for (const std::string& name : excluded) {
    if (auto it = picked_.find(name); it != picked_.end()) exclude.push_back(it->second.get());
  }
  std::shared_ptr<PooledWorker> w = pool_.Pick(session_id, exclude);
  if (w == nullptr) return "";
  std::string name = w->address();
  picked_[name] = std::move(w);
  return name;
}

std::unique_ptr<WorkerCall> PoolWorkers::Call(absl::string_view worker,
                                              const wv1::GenerateRequest& request,
                                              int64_t expected_tokens) {
  auto it = picked_.find(worker);
  if (it == picked_.end()) return nullptr;  // not a worker Pick returned: a driver bug
  return std::make_unique<PoolWorkerCall>(it->second, watchdog_, context_, request,
                                          expected_tokens);
}

void PoolWorkers::ReportFailure(absl::string_view worker) {
  if (auto it = picked_.find(worker); it != picked_.end()) pool_.ReportFailure(*it->second);
}

}  // namespace infinigen
