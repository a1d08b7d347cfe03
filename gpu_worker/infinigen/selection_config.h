// Settings of the KV selection policies (INFINIGEN.md): which policy, its budget and knobs.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gpu_worker/kv/kv_selection.h"
#include "gpu_worker/model/config.h"

namespace infinigen {

struct InfinigenSidecar;

// Which rows a decode step reads (INFINIGEN.md, "Baselines"): every row, InfiniGen's
// speculation, or one of the paper's comparisons.
enum class PolicyKind { kFull, kInfinigen, kH2o, kWindow, kOracle };
// "full", "infinigen", "h2o", "window", "oracle".
const char* PolicyKindName(PolicyKind kind);
// INVALID_ARGUMENT listing the names for anything else.
absl::StatusOr<PolicyKind> ParsePolicyKind(absl::string_view name);

struct SelectionConfig {
  PolicyKind policy = PolicyKind::kFull;
  int dense_layers = 2;  // layers below this always attend to every row
  // Budget: the most rows per KV head a decode step reads: budget_tokens when > 0, else
  // ceil(budget_fraction x stored rows). InfiniGen reads fewer when its threshold says so.
  double budget_fraction = 0.2;
  int64_t budget_tokens = 0;
  // Never fewer rows than this: a sequence shorter than it attends densely. Selecting 2 of 8
  // rows ruins generation and saves nothing worth having; the serving default is 256, the
  // accuracy harness uses 0 (the budget alone, as the paper measures).
  int64_t min_budget_tokens = 0;
  int64_t min_tokens = 1;  // InfiniGen's k_min
  // InfiniGen: rows within alpha logits of the head's best. The paper's 5 reads ~5% of the rows
  // of SmolLM2 and loses 2x perplexity; 10 is the measured knee (docs/accuracy.md).
  double alpha = 10.0;
  int64_t sink_tokens = 0;           // always-kept first tokens (window: 4 unless set)
  int64_t recent_tokens = 0;         // always-kept latest tokens (InfiniGen option)
  double h2o_recent_fraction = 0.5;  // H2O: share of the budget for the recent window
  SpeculationInput speculation = SpeculationInput::kPreviousNorm;

  // Rows allowed for `stored` valid rows.
  int64_t Budget(int64_t stored) const;
  // INVALID_ARGUMENT naming the field.
  absl::Status Validate() const;
};

// What a request may change, and within which bounds the server lets it (per model config).
struct SelectionOverrides {
  std::optional<PolicyKind> policy;
  std::optional<double> budget_fraction;
  std::optional<double> alpha;
};
struct SelectionLimits {
  std::vector<PolicyKind> allowed_policies = {PolicyKind::kFull, PolicyKind::kInfinigen,
                                              PolicyKind::kH2o, PolicyKind::kWindow,
                                              PolicyKind::kOracle};
  double min_budget_fraction = 0.05;  // below this, quality collapses for every policy
  double max_budget_fraction = 1.0;
  double min_alpha = 1.0, max_alpha = 30.0;
};
// The model's defaults with a request's overrides applied; INVALID_ARGUMENT naming the limit a
// request breaks.
absl::StatusOr<SelectionConfig> ApplyOverrides(const SelectionConfig& defaults,
                                               const SelectionOverrides& overrides,
                                               const SelectionLimits& limits);

struct PartialSkewOnBackend;
// The policy `config.policy` for a model. InfiniGen needs its prepared sidecar; given its skew in
// the model's backend's memory (UploadPartialSkew), it chooses rows there where the host cannot
// read that memory (a GPU: MakeInfinigenPolicy).
absl::StatusOr<std::unique_ptr<KvSelectionPolicy>> MakeSelectionPolicy(
    const SelectionConfig& config, const ModelConfig& model, const InfinigenSidecar* sidecar,
    std::shared_ptr<const PartialSkewOnBackend> skew = nullptr);

}  // namespace infinigen
