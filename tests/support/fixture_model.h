// A checkpoint loaded on the CPU backend, and logits helpers, for tests.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/model.h"

namespace infinigen::testing {

struct LoadedModel {
  std::unique_ptr<Checkpoint> ckpt;
  std::unique_ptr<CpuBackend> backend;
  std::unique_ptr<Model> model;
};

// Opens and loads `dir` (records test failures; `model` is null when loading failed).
LoadedModel LoadModel(const std::string& dir);

// Logits of every token of `tokens` as sequence 7 of a fresh resident cache, fed to the model in
// chunks of `chunk` tokens (records test failures).
std::vector<float> ChunkedLogits(Model& model, const std::vector<int32_t>& tokens, int64_t chunk);

// The greedy continuation of `prompt` (EOS ignored) over a fresh resident cache; empty after
// recording a failure when generation fails.
std::vector<int32_t> GreedyTokens(Model& model, const std::vector<int32_t>& prompt,
                                  int64_t max_new_tokens);

// max |a[i] - b[i]| (records a failure when the sizes differ).
float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b);

struct DecodeRun {
  std::vector<std::vector<int32_t>> tokens;        // per sequence
  std::vector<float> logits;                       // every step's logits, all sequences
  int64_t prefetch_hits = 0, prefetch_misses = 0;  // DecodeStep's
  StepProfile profile;                             // of its decode-only steps
  int64_t bytes_fetched = 0;                       // the cache's FetchCounters, all sequences
  int64_t bytes_reused = 0;                        // ... read where the device kept them
};

// Greedy decode of `prompts` as sequences 1, 2, ... of `cache`, one batch per step, with
// policies[i] selecting the rows of sequence i + 1 (null: dense). Prefill in chunks of `chunk`
// tokens, one sequence at a time, or (chunk >= 1000) every whole prompt in one forward pass.
// Each sequence is opened with room for `capacity` tokens (a hint the run may pass).
// Records test failures; closes the sequences and releases them from their policies at the end.
DecodeRun Decode(Model& model, KvCache& cache, std::vector<KvSelectionPolicy*> policies,
                 const std::vector<std::vector<int32_t>>& prompts, int64_t steps, int64_t chunk,
                 int64_t capacity = 256);

// What a run of Mixed gives: every step's greedy tokens and logits (a row per chunk that has
// one), each step's waits and whether a prompt chunk was in it, and the bytes moved.
struct MixedRun {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<float> logits;
  std::vector<int64_t> waits;
  std::vector<bool> mixed;
  int64_t bytes_fetched = 0, bytes_reused = 0;
};

// Greedy decode with a prompt prefilled beside it (the engine's steps while a prompt arrives):
// sequences 1 and 2 of `cache` prefilled alone, then decoded `steps` steps while sequence 3's
// prompt is prefilled beside them in chunks of 8 tokens (the last one shorter), sequence 3
// decoding from the step after its last chunk; policies[i] chooses for sequence i + 1 (not
// null). Each is opened with room for 256 tokens. Records test failures; closes the sequences
// and releases them from their policies at the end.
MixedRun Mixed(Model& model, KvCache& cache, std::vector<KvSelectionPolicy*> policies,
               const std::vector<std::vector<int32_t>>& prompts, int64_t steps);

// `n` token ids in [0, vocab), the same for the same seed.
std::vector<int32_t> RandomTokens(int64_t n, int64_t vocab, unsigned seed);

}  // namespace infinigen::testing
