// InfiniGen choosing in backend memory (INFINIGEN.md, "Decode step"; docs/cuda.md): the same
// decisions as the host policy (infinigen_policy.cc), with the partial key cache of every
// (sequence, sparse layer) in the backend's memory (PartialKeysShape) and the speculated
// scores, alpha count, budget, group mass and top-k computed there (Backend::ChooseRows).
// DecodeStep reads back only the chosen rows: on a GPU nothing is scored on the host.
#include <algorithm>
#include <cmath>
#include <memory>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu_worker/infinigen/infinigen_policy.h"
#include "kernels/cpu/selection.h"

namespace infinigen {
namespace {

// Rows a partial key cache of a sequence not opened (no capacity) starts with (it doubles when
// full).
constexpr int64_t kInitialRows = 1024;

class InfinigenBackendPolicy final : public KvSelectionPolicy {
 public:
  InfinigenBackendPolicy(const SelectionConfig& config, const ModelConfig& model,
                         std::shared_ptr<const PartialSkewOnBackend> skew)
      : config_(config),
        model_(model),
        partial_dim_(skew->partial_dim),
        backend_(*skew->backend),
        skew_(std::move(skew)) {}

  std::string Name() const override { return "infinigen"; }
  SpeculationInput speculation_input() const override { return config_.speculation; }
  bool SpeculatesFor(int layer) const override { return layer >= config_.dense_layers; }
  bool chooses_on_backend() const override { return true; }

  int64_t BackendChoiceCapacity(int64_t rows) const override {
    const int64_t budget = config_.Budget(std::max<int64_t>(rows + 1, 1));
    return std::min(rows + 1, budget + cpu::PrefetchMargin(budget));
  }

  void Open(SequenceId seq, int64_t capacity_tokens) override {
    sequences_[seq].capacity = capacity_tokens;
  }
  void Release(SequenceId seq) override { sequences_.erase(seq); }
  // The partial keys of every sparse layer and the choices' workspace, both sized at the first
  // prefill for the capacity Open gave (KeysFor, EnsureWorkspace).
  size_t BackendBytesFor(int64_t capacity_tokens) const override {
    const int64_t capacity = std::max<int64_t>(capacity_tokens, 1);
    const size_t sparse = static_cast<size_t>(
        std::max<int64_t>(0, model_.num_layers - std::max(config_.dense_layers, 0)));
    return sparse * Shape(capacity).Bytes() +
           backend_.ChooseRowsWorkspaceBytes(static_cast<int>(model_.num_heads),
                                             static_cast<int>(model_.num_kv_heads), capacity);
  }

  absl::Status OnBackendKeys(SequenceId seq, int layer, MatView k,
                             int64_t first_position) override {
    if (layer < config_.dense_layers || k.rows == 0) return absl::OkStatus();
    IG_ASSIGN_OR_RETURN(Keys * keys, KeysFor(seq, layer, first_position + k.rows));
    // The choices' workspace for the whole sequence, now (a prefill), not in a decode step.
    IG_RETURN_IF_ERROR(EnsureWorkspace(keys->capacity));
    return backend_.AppendPartialKeys(k, static_cast<const float*>(skew_->layers[layer]->data()),
                                      Shape(keys->capacity), keys->buffer->data(), first_position);
  }

  absl::StatusOr<BackendChoiceResult> ChooseOnBackend(const BackendChoice& c) override {
    const int64_t n = c.rows;
    if (n <= 0) return BackendChoiceResult::kNone;
    if (c.layer < config_.dense_layers) return BackendChoiceResult::kAll;
    // The host policy's short cuts (Preselect: the budget covers every stored row; Select: too
    // few rows to choose among).
    const int64_t k_max = config_.Budget(c.prefetch ? n + 1 : n);
    if (c.prefetch ? k_max > n : n <= config_.min_budget_tokens) return BackendChoiceResult::kAll;
    if (c.speculated_q.data == nullptr) {
      if (c.prefetch) return BackendChoiceResult::kNone;  // no guess: nothing prefetched
      return absl::InternalError("infinigen: the model did not provide a speculated query");
    }
    if (c.index_capacity < BackendChoiceCapacity(c.prefetch ? n : n - 1)) {
      return absl::InternalError("infinigen: the index buffer is smaller than the budget");
    }
    IG_ASSIGN_OR_RETURN(Keys * keys, KeysFor(c.seq, c.layer, n));
    const int heads = static_cast<int>(model_.num_heads);
    IG_RETURN_IF_ERROR(EnsureWorkspace(n));
    RowChoiceRequest r;
    r.q_partial = c.speculated_q;
    r.keys = keys->buffer->data();
    r.keys_shape = Shape(keys->capacity);
    r.num_heads = heads;
    r.scale = 1.0f / std::sqrt(static_cast<float>(model_.head_dim));
    r.alpha = static_cast<float>(config_.alpha);
    r.rows = n;
    r.k_min = std::max(config_.min_tokens, config_.min_budget_tokens);
    r.k_max = k_max;
    r.margin = c.prefetch;
    r.force_last = !c.prefetch;
    r.indices = c.indices;
    r.index_capacity = c.index_capacity;
    r.count = c.count;
    IG_RETURN_IF_ERROR(backend_.ChooseRows(r, workspace_ ? workspace_->data() : nullptr));
    return BackendChoiceResult::kLaunched;
  }

  // DecodeStep asks ChooseOnBackend instead.
  absl::Status Select(const SelectRequest&, Selection&) override {
    return absl::InternalError("infinigen chooses on the backend: Select is not used");
  }

 private:
  struct Keys {
    std::unique_ptr<Buffer> buffer;
    int64_t capacity = 0;
  };
  struct Sequence {
    int64_t capacity = 0;  // Open's
    std::vector<Keys> layers;
  };

  // Room in workspace_ for a choice over `rows` rows (grows by half at least).
  absl::Status EnsureWorkspace(int64_t rows) {
    const size_t bytes = backend_.ChooseRowsWorkspaceBytes(
        static_cast<int>(model_.num_heads), static_cast<int>(model_.num_kv_heads), rows);
    if (bytes == 0 || (workspace_ != nullptr && workspace_->size() >= bytes)) {
      return absl::OkStatus();
    }
    const size_t grown = workspace_ ? std::max(bytes, workspace_->size() * 3 / 2) : bytes;
    workspace_.reset();
    IG_ASSIGN_OR_RETURN(workspace_, backend_.Allocate(grown));
    return absl::OkStatus();
  }

  PartialKeysShape Shape(int64_t capacity) const {
    return {static_cast<int>(model_.num_kv_heads), static_cast<int>(model_.head_dim), partial_dim_,
            capacity};
  }

  // The partial keys of (seq, layer) with room for `rows` rows: sized for the sequence's opened
  // capacity on first use, doubled (and copied) when a sequence outgrows it.
  absl::StatusOr<Keys*> KeysFor(SequenceId seq, int layer, int64_t rows) {
    Sequence& s = sequences_[seq];
    if (static_cast<int>(s.layers.size()) < model_.num_layers) s.layers.resize(model_.num_layers);
    Keys& keys = s.layers[layer];
    if (keys.capacity >= rows) return &keys;
    const int64_t capacity = std::max({rows, s.capacity, keys.capacity * 2,
                                       keys.capacity > 0 || s.capacity > 0 ? 0 : kInitialRows});
    IG_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> grown, backend_.Allocate(Shape(capacity).Bytes()));
    if (keys.capacity > 0) {  // channel rows: [kv_heads * partial_dim, capacity]
      const int64_t channels = model_.num_kv_heads * partial_dim_;
      IG_RETURN_IF_ERROR(backend_.Copy(
          MatView{keys.buffer->data(), DType::kBF16, channels, keys.capacity, keys.capacity},
          MatView{grown->data(), DType::kBF16, channels, keys.capacity, capacity}));
    }
    keys.buffer = std::move(grown);
    keys.capacity = capacity;
    return &keys;
  }

  SelectionConfig config_;
  const ModelConfig& model_;
  int partial_dim_;
  Backend& backend_;
  std::shared_ptr<const PartialSkewOnBackend> skew_;
  absl::flat_hash_map<SequenceId, Sequence> sequences_;
  std::unique_ptr<Buffer> workspace_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<const PartialSkewOnBackend>> UploadPartialSkew(
    const InfinigenSidecar& sidecar, Backend& backend) {
  auto skew = std::make_shared<PartialSkewOnBackend>();
  skew->backend = &backend;
  skew->partial_dim = static_cast<int>(sidecar.partial_dim);
  for (int l = 0; l < sidecar.num_layers; ++l) {
    const std::vector<float> host = sidecar.PartialSkew(l);
    IG_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> layer,
                        backend.Allocate(host.size() * sizeof(float)));
    IG_RETURN_IF_ERROR(
        backend.CopyToDevice(host.data(), layer->data(), host.size() * sizeof(float)));
    skew->layers.push_back(std::move(layer));
  }
  return std::shared_ptr<const PartialSkewOnBackend>(std::move(skew));
}

bool ChoosesOnBackend(const SelectionConfig& config, const PartialSkewOnBackend* skew) {
  return skew != nullptr && !skew->backend->host_accessible() &&
         (config.speculation == SpeculationInput::kPreviousNorm ||
          config.speculation == SpeculationInput::kThisLayerNorm) &&
         config.sink_tokens == 0 && config.recent_tokens == 0;
}

std::unique_ptr<KvSelectionPolicy> MakeInfinigenBackendPolicy(
    const SelectionConfig& config, const ModelConfig& model,
    std::shared_ptr<const PartialSkewOnBackend> skew) {
  return std::make_unique<InfinigenBackendPolicy>(config, model, std::move(skew));
}

}  // namespace infinigen
