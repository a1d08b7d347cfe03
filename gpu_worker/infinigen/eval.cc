#include "gpu_worker/infinigen/eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "gpu_worker/kv/store_kv_cache.h"
#include "kv_store/client/transports.h"
#include "kv_store/kv_store.h"

namespace infinigen {
namespace {

// The cache a measurement decodes with, and the store it lives in (through_store).
struct EvalCache {
  std::unique_ptr<KvStore> store;
  std::unique_ptr<KvStoreClient> client;
  std::unique_ptr<KvCache> cache;  // destroyed first: it uses the client, which uses the store
  KvCache& operator*() { return *cache; }
};

absl::StatusOr<EvalCache> MakeCache(Model& model, const EvalOptions& o) {
  EvalCache c;
  if (o.through_store) {
    const KvCacheShape shape = model.kv_shape();
    KvStoreConfig sc;
    // Room for every sequence one measurement keeps open (one at a time) at its full length.
    sc.capacity_bytes = static_cast<size_t>(2 * int64_t{shape.num_layers} * shape.num_kv_heads *
                                            shape.head_dim * DTypeSize(shape.dtype)) *
                            static_cast<size_t>(o.context + 64) +
                        (size_t{64} << 20);
    sc.max_row_bytes = std::max<int64_t>(sc.max_row_bytes, shape.head_dim * 4);
    sc.shared_memory = false;
    sc.huge_pages = false;
    IG_ASSIGN_OR_RETURN(c.store, KvStore::Create(sc));
    KvClientConfig cc;
    cc.transport = KvClientConfig::Transport::kInProcess;
    cc.store = c.store.get();
    cc.renew_every = absl::ZeroDuration();
    IG_ASSIGN_OR_RETURN(c.client, MakeInProcessClient(cc));
    StoreKvCacheOptions options;
    if (o.use_kv_pool) options.pool = o.kv_pool;
    c.cache = std::make_unique<StoreKvCache>(model.backend(), shape, *c.client, options);
  } else if (o.use_kv_pool) {
    c.cache = std::make_unique<KvPoolCache>(model.backend(), model.kv_shape(), o.kv_pool);
  } else {
    c.cache = std::make_unique<BackendKvCache>(model.backend(), model.kv_shape());
  }
  return c;
}

int32_t Argmax(const std::vector<float>& logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

double Nll(const std::vector<float>& logits, int32_t target) {
  const float mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float l : logits) sum += std::exp(l - mx);
  return std::log(sum) + mx - logits[target];
}

// Feeds `tokens` to sequence `seq`: the first `dense` densely in chunks, the rest one at a time
// with the policy. Calls on_step(t, logits) after each single-token step t (index into tokens)
// and once after the dense part with t = dense - 1.
template <typename OnStep>
absl::Status Feed(Model& model, KvCache& cache, KvSelectionPolicy* policy, SequenceId seq,
                  std::span<const int32_t> tokens, int64_t dense, int64_t chunk, OnStep on_step) {
  std::vector<float> logits(model.config().vocab_size);
  IG_RETURN_IF_ERROR(cache.Open(seq, static_cast<int64_t>(tokens.size())));
  if (policy != nullptr) policy->Open(seq, static_cast<int64_t>(tokens.size()));
  for (int64_t pos = 0; pos < dense; pos += chunk) {
    const int64_t len = std::min(chunk, dense - pos);
    ForwardChunk c{seq, pos, tokens.subspan(pos, len), false, policy};
    IG_RETURN_IF_ERROR(DecodeStep(model, cache).Forward({&c, 1}, logits));
  }
  on_step(dense - 1, logits);
  for (int64_t t = dense; t < static_cast<int64_t>(tokens.size()); ++t) {
    ForwardChunk c{seq, t, tokens.subspan(t, 1), false, policy};
    IG_RETURN_IF_ERROR(DecodeStep(model, cache).Forward({&c, 1}, logits));
    on_step(t, logits);
  }
  cache.Close(seq);
  if (policy != nullptr) policy->Release(seq);
  return absl::OkStatus();
}

// Greedy generation of `steps` tokens after `prompt`.
absl::StatusOr<std::vector<int32_t>> Greedy(Model& model, KvCache& cache, KvSelectionPolicy* policy,
                                            SequenceId seq, std::span<const int32_t> prompt,
                                            int64_t steps, int64_t chunk) {
  std::vector<int32_t> out;
  std::vector<float> logits(model.config().vocab_size);
  const int64_t n = static_cast<int64_t>(prompt.size());
  IG_RETURN_IF_ERROR(cache.Open(seq, n + steps));
  if (policy != nullptr) policy->Open(seq, n + steps);
  for (int64_t pos = 0; pos < n; pos += chunk) {
    const int64_t len = std::min(chunk, n - pos);
    ForwardChunk c{seq, pos, prompt.subspan(pos, len), false, policy};
    IG_RETURN_IF_ERROR(DecodeStep(model, cache).Forward({&c, 1}, logits));
  }
  for (int64_t s = 0; s < steps; ++s) {
    out.push_back(Argmax(logits));
    if (s + 1 == steps) break;
    ForwardChunk c{seq, n + s, std::span<const int32_t>(&out.back(), 1), false, policy};
    IG_RETURN_IF_ERROR(DecodeStep(model, cache).Forward({&c, 1}, logits));
  }
  cache.Close(seq);
  if (policy != nullptr) policy->Release(seq);
  return out;
}

absl::Status CheckWindows(std::span<const int32_t> corpus, const EvalOptions& o) {
  if (o.context < 2 || o.eval_tokens < 1 || o.eval_tokens >= o.context || o.windows < 1) {
    return absl::InvalidArgumentError(
        "need context >= 2, 1 <= eval_tokens < context and windows >= 1");
  }
  if (static_cast<int64_t>(corpus.size()) < o.context * o.windows) {
    return absl::InvalidArgumentError(absl::StrCat("the corpus has ", corpus.size(), " tokens; ",
                                                   o.windows, " windows of ", o.context, " need ",
                                                   o.context * o.windows));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<int32_t>> DenseGreedy(Model& model, std::span<const int32_t> corpus,
                                                 const EvalOptions& o) {
  IG_RETURN_IF_ERROR(CheckWindows(corpus, o));
  IG_ASSIGN_OR_RETURN(EvalCache cache, MakeCache(model, o));
  return Greedy(model, *cache, nullptr, 1, corpus.subspan(0, o.context - o.generate_tokens),
                o.generate_tokens, o.prefill_chunk);
}

absl::StatusOr<EvalResult> Evaluate(Model& model, std::span<const int32_t> corpus,
                                    std::span<const int32_t> haystack, const Tokenizer* tokenizer,
                                    KvSelectionPolicy* policy, int dense_layers,
                                    const EvalOptions& o,
                                    std::span<const int32_t> reference_greedy) {
  IG_RETURN_IF_ERROR(CheckWindows(corpus, o));
  const auto t0 = std::chrono::steady_clock::now();
  EvalResult result;
  result.policy = policy != nullptr ? policy->Name() : "full";
  std::unique_ptr<MeteredPolicy> metered;
  if (policy != nullptr) {
    metered =
        std::make_unique<MeteredPolicy>(*policy, model.config(), dense_layers, o.measure_recall);
  }
  KvSelectionPolicy* active = metered.get();
  IG_ASSIGN_OR_RETURN(EvalCache cache, MakeCache(model, o));

  // Perplexity over the windows' tails.
  double nll = 0;
  SequenceId seq = 1;
  for (int64_t w = 0; w < o.windows; ++w) {
    auto window = corpus.subspan(w * o.context, o.context);
    const int64_t dense = o.context - o.eval_tokens;
    IG_RETURN_IF_ERROR(Feed(model, *cache, active, seq++, window, dense, o.prefill_chunk,
                            [&](int64_t t, const std::vector<float>& logits) {
                              if (t + 1 < o.context) {
                                nll += Nll(logits, window[t + 1]);
                                ++result.scored_tokens;
                              }
                            }));
  }
  result.perplexity = std::exp(nll / result.scored_tokens);
  if (metered != nullptr) result.meter = metered->meter();

  // Greedy agreement along dense attention's continuation.
  if (!reference_greedy.empty()) {
    const int64_t g = static_cast<int64_t>(reference_greedy.size());
    std::vector<int32_t> tokens(corpus.begin(), corpus.begin() + (o.context - g));
    tokens.insert(tokens.end(), reference_greedy.begin(), reference_greedy.end());
    const int64_t dense = o.context - g;
    int64_t agree = 0;
    IG_RETURN_IF_ERROR(Feed(model, *cache, active, seq++, tokens, dense, o.prefill_chunk,
                            [&](int64_t t, const std::vector<float>& logits) {
                              const int64_t i = t - (dense - 1);  // index into the reference
                              if (i < g) agree += Argmax(logits) == reference_greedy[i];
                            }));
    result.greedy_agreement = static_cast<double>(agree) / g;
    IG_ASSIGN_OR_RETURN(
        std::vector<int32_t> free_run,
        Greedy(model, *cache, active, seq++, corpus.subspan(0, dense), g, o.prefill_chunk));
    while (result.greedy_identical_prefix < g &&
           free_run[result.greedy_identical_prefix] ==
               reference_greedy[result.greedy_identical_prefix]) {
      ++result.greedy_identical_prefix;
    }
  }

  // Passkey retrieval.
  if (tokenizer != nullptr && !o.passkey_depths.empty()) {
    const std::string key = "71432";
    const auto intro = tokenizer->Encode(
        "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the pass key.\n",
        /*add_special=*/true);
    const auto needle = tokenizer->Encode("\nThe pass key is " + key + ". Remember it. " + key +
                                          " is the pass key.\n");
    const auto question = tokenizer->Encode("\nWhat is the pass key? The pass key is");
    const int64_t room =
        o.context - static_cast<int64_t>(intro.size() + needle.size() + question.size()) - 8;
    if (room < 16 || static_cast<int64_t>(haystack.size()) < room) {
      return absl::InvalidArgumentError("the haystack text is too short for the passkey context");
    }
    for (double depth : o.passkey_depths) {
      const int64_t before = static_cast<int64_t>(depth * room);
      std::vector<int32_t> prompt = intro;
      prompt.insert(prompt.end(), haystack.begin(), haystack.begin() + before);
      prompt.insert(prompt.end(), needle.begin(), needle.end());
      prompt.insert(prompt.end(), haystack.begin() + before, haystack.begin() + room);
      prompt.insert(prompt.end(), question.begin(), question.end());
      IG_ASSIGN_OR_RETURN(std::vector<int32_t> answer,
                          Greedy(model, *cache, active, seq++, prompt, 8, o.prefill_chunk));
      ++result.passkey_total;
      result.passkey_found += tokenizer->Decode(answer, true).find(key) != std::string::npos;
    }
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace infinigen
