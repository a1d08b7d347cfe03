#include "gpu_worker/engine/generator.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu_worker/engine/decode_step.h"

namespace infinigen {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Closes the sequence however generation ends.
class SequenceGuard {
 public:
  SequenceGuard(KvCache& cache, SequenceId seq) : cache_(cache), seq_(seq) {}
  ~SequenceGuard() { cache_.Close(seq_); }

 private:
  KvCache& cache_;
  SequenceId seq_;
};

}  // namespace

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kCancelled:
      return "cancelled";
  }
  return "?";
}

absl::StatusOr<GenerateResult> Generate(Model& model, KvCache& cache, SequenceId seq,
                                        std::span<const int32_t> prompt,
                                        const GenerateOptions& options,
                                        const TokenCallback& on_token) {
  IG_RETURN_IF_ERROR(options.Validate());
  const ModelConfig& c = model.config();
  IG_RETURN_IF_ERROR(options.ValidateForModel(prompt, c.vocab_size, c.max_position_embeddings));
  const int64_t total = static_cast<int64_t>(prompt.size()) + options.max_new_tokens;
  std::vector<int32_t> stops = options.stop_token_ids;
  if (!options.ignore_eos)
    stops.insert(stops.end(), c.eos_token_ids.begin(), c.eos_token_ids.end());

  IG_RETURN_IF_ERROR(cache.Open(seq, total));
  SequenceGuard guard(cache, seq);

  GenerateResult result;
  result.prompt_tokens = static_cast<int64_t>(prompt.size());
  if (options.max_new_tokens == 0) return result;

  std::vector<int32_t> history(prompt.begin(), prompt.end());
  history.reserve(total);
  std::vector<float> logits(c.vocab_size);
  SamplingScratch scratch;
  const auto t0 = std::chrono::steady_clock::now();

  DecodeStep decode(model, cache);
  // Prefill in chunks; only the last chunk's last token needs logits.
  int64_t pos = 0;
  const int64_t n_prompt = static_cast<int64_t>(prompt.size());
  while (pos < n_prompt) {
    const int64_t len = std::min(options.prefill_chunk_tokens, n_prompt - pos);
    ForwardChunk chunk{seq, pos, prompt.subspan(pos, len), false};
    IG_RETURN_IF_ERROR(decode.Forward({&chunk, 1}, logits));
    pos += len;
  }

  auto t_first = t0;
  for (int64_t step = 0; step < options.max_new_tokens; ++step) {
    if (step > 0) {
      ForwardChunk chunk{seq, pos, std::span<const int32_t>(&history.back(), 1), false};
      IG_RETURN_IF_ERROR(decode.Forward({&chunk, 1}, logits));
      ++pos;
    }
    const int32_t token = SampleToken(logits, options.sampling, history,
                                      std::span<const int32_t>(history).subspan(prompt.size()),
                                      static_cast<uint64_t>(history.size()), scratch);
    if (step == 0) {
      result.prefill_seconds = SecondsSince(t0);
      t_first = std::chrono::steady_clock::now();
    }
    history.push_back(token);
    result.tokens.push_back(token);
    if (on_token && !on_token(token)) {
      result.finish_reason = FinishReason::kCancelled;
      break;
    }
    if (std::find(stops.begin(), stops.end(), token) != stops.end()) {
      result.finish_reason = FinishReason::kStop;
      break;
    }
  }
  result.decode_seconds = SecondsSince(t_first);
  return result;
}

}  // namespace infinigen
