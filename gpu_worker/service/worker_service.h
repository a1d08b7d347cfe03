// The gRPC face of a worker (infinigen.worker.v1.Worker): turns a GenerateRequest into prompt
// tokens, sampling options and a selection policy, submits it to the BatchEngine, and streams
// the engine's tokens back as ids and text deltas, then usage and timings. A client that goes
// away or cancels ends the request in the engine, which frees its KV store sequence.
#pragma once

#include <atomic>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "frontend/request_validation.h"
#include "frontend/sample_text.h"
#include "gpu_worker/engine/batch_engine.h"
#include "gpu_worker/infinigen/infinigen_policy.h"
#include "gpu_worker/infinigen/selection_config.h"
#include "gpu_worker/infinigen/sidecar.h"
#include "gpu_worker/structured/json_token_mask.h"
#include "gpu_worker/tokenizer/tokenizer.h"
#include "infinigen/worker/v1/worker.grpc.pb.h"

namespace prometheus {
class Histogram;
}

namespace infinigen {

struct WorkerServiceOptions {
  std::string model_name;
  std::string kv_transport;
  SelectionConfig selection;  // the defaults requests start from
  SelectionLimits selection_limits;
  RequestLimits limits = WorkerRequestLimits();
  EngineConfig engine;  // as the engine was built (for Info)
  // InfiniGen's skew in the model's backend's memory, where the host cannot read it (a GPU):
  // the policies choose rows there (UploadPartialSkew).
  std::shared_ptr<const PartialSkewOnBackend> skew_on_backend;
};

// Latency observers for the metrics endpoint (optional).
struct WorkerLatencyMetrics {
  prometheus::Histogram* time_to_first_token = nullptr;
  prometheus::Histogram* time_per_output_token = nullptr;
};

class WorkerService final : public worker::v1::Worker::Service {
 public:
  // Everything passed in must outlive the service. `sidecar` may be null (no infinigen);
  // `tokenizer` may be null (a model without tokenizer files: token ids in, no text out).
  WorkerService(BatchEngine& engine, const Model& model, const Tokenizer* tokenizer,
                const InfinigenSidecar* sidecar, const WorkerServiceOptions& options);

  grpc::Status Generate(grpc::ServerContext* context, const worker::v1::GenerateRequest* request,
                        grpc::ServerWriter<worker::v1::GenerateResponse>* writer) override;
  grpc::Status Info(grpc::ServerContext* context, const worker::v1::InfoRequest* request,
                    worker::v1::InfoResponse* response) override;
  grpc::Status Tokenize(grpc::ServerContext* context, const infinigen::v1::TokenizeRequest* request,
                        infinigen::v1::TokenizeResponse* response) override;

  // New requests get UNAVAILABLE while draining; running ones finish.
  void SetDraining(bool draining) { draining_ = draining; }
  void SetLatencyMetrics(const WorkerLatencyMetrics& m) { latency_ = m; }

 private:
  // The last message of sample `index` (its finish, usage and timings; `resumed`: the tokens it
  // streamed elsewhere), with the text it still held back; observes the latency metrics.
  worker::v1::GenerateResponse LastMessage(int index, int64_t resumed, const EngineEvent& e,
                                           SampleText& text, const std::string& policy_name);
  absl::StatusOr<std::string> RenderChat(const infinigen::v1::ChatMessages& messages) const;
  absl::StatusOr<std::vector<int32_t>> PromptTokens(const worker::v1::GenerateRequest& r) const;
  absl::StatusOr<GenerateOptions> Options(const worker::v1::GenerateRequest& r) const;
  absl::StatusOr<std::unique_ptr<KvSelectionPolicy>> Policy(
      const worker::v1::GenerateRequest& r) const;
  // response_format JSON_OBJECT's mask for one sample, past its `resumed` tokens.
  absl::StatusOr<std::unique_ptr<TokenConstraint>> JsonConstraint(std::span<const int32_t> resumed);

  BatchEngine& engine_;
  const Model& model_;
  const Tokenizer* tokenizer_;
  const InfinigenSidecar* sidecar_;
  const WorkerServiceOptions options_;
  const std::string backend_name_;  // Backend::Name(), asked once (CUDA queries the device)
  std::atomic<bool> draining_{false};
  WorkerLatencyMetrics latency_;
  absl::Mutex json_mu_;
  // The tokenizer's bytes per token, read at the first JSON_OBJECT request.
  std::shared_ptr<const JsonVocabulary> json_vocabulary_ ABSL_GUARDED_BY(json_mu_);
};

}  // namespace infinigen
