// `infinigen eval`: accuracy of a selection policy against dense attention (INFINIGEN.md, "What
// to measure"). All measurements decode token by token with the policy active, since prefill is
// always dense:
//  - perplexity: each window of `context` corpus tokens is prefilled densely up to its last
//    `eval_tokens` tokens, which are then fed one at a time (teacher forcing); the mean NLL of
//    those tokens over all windows;
//  - KV rows read vs a full fetch, for all layers and for the sparse ones;
//  - attention-mass recall of the selected rows vs the oracle's top-k at the same k;
//  - greedy agreement: the policy, teacher-forced along dense attention's greedy continuation,
//    picks the same next token;
//  - passkey retrieval: a number hidden at several depths of a long haystack.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu_worker/infinigen/metered_policy.h"
#include "gpu_worker/kv/kv_pool_cache.h"
#include "gpu_worker/model/model.h"
#include "gpu_worker/tokenizer/tokenizer.h"

namespace infinigen {

struct EvalOptions {
  int64_t context = 2048;              // tokens per window
  int64_t eval_tokens = 256;           // decoded tokens per window (perplexity)
  int64_t windows = 1;                 // consecutive corpus windows
  int64_t generate_tokens = 0;         // greedy agreement length (0 = skip)
  std::vector<double> passkey_depths;  // fractions of the haystack (empty = skip)
  bool measure_recall = true;
  bool use_kv_pool = false;  // decode with a KV pool (eviction) instead of a resident cache
  KvPoolConfig kv_pool;
  // The K/V in a KV store in this process, read as the worker reads them (StoreKvCache: the
  // cross-layer prefetch, the KV pool's slots sent with the appends), instead of resident.
  bool through_store = false;
  int64_t prefill_chunk = 512;
};

struct EvalResult {
  std::string policy;
  double perplexity = 0.0;
  int64_t scored_tokens = 0;
  SelectionMeter meter;
  double greedy_agreement = 1.0;        // teacher-forced top-1 agreement with dense
  int64_t greedy_identical_prefix = 0;  // free-running tokens equal to dense before a divergence
  int64_t passkey_found = 0, passkey_total = 0;
  double seconds = 0.0;
};

// Runs every measurement for `policy` (null = dense attention). `reference_greedy` is dense
// attention's greedy continuation of the first window's prompt (from DenseGreedy), empty to
// skip agreement. `tokenizer` is needed for passkeys (null = skip).
absl::StatusOr<EvalResult> Evaluate(Model& model, std::span<const int32_t> corpus,
                                    std::span<const int32_t> haystack, const Tokenizer* tokenizer,
                                    KvSelectionPolicy* policy, int dense_layers,
                                    const EvalOptions& options,
                                    std::span<const int32_t> reference_greedy);

// Dense attention's greedy continuation used as the agreement reference.
absl::StatusOr<std::vector<int32_t>> DenseGreedy(Model& model, std::span<const int32_t> corpus,
                                                 const EvalOptions& options);

}  // namespace infinigen
