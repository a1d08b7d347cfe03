// BatchEngine: continuous batching of many generation requests over one Model and KvCache.
// One engine thread runs steps; a step is one Model::Forward over a ragged batch holding one
// decode token of every running sequence plus prompt chunks of sequences still in prefill, up to
// a per-step prefill budget so that long prompts do not stall the running decodes. Requests join
// between steps (admission by queue length and by the cache accepting the sequence) and leave
// when they finish, are cancelled, pass their deadline, or fail; leaving closes the sequence in
// the cache (the KV store) and releases its policy state at once. A failure of one sequence in
// a step (the store lost its rows, a fetch timed out: ABORTED) ends that request alone; the
// others of the batch go on with the logits they would have had without it.
//
// Events reach the caller through a sink called on the engine thread: keep it short.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/engine/generator.h"
#include "gpu_worker/engine/session_table.h"
#include "gpu_worker/engine/token_constraint.h"
#include "gpu_worker/kv/kv_cache.h"
#include "gpu_worker/model/model.h"

namespace infinigen {

struct EngineConfig {
  int max_running = 16;  // sequences in the batch at once
  int max_queued = 64;   // admitted requests waiting for a batch slot; more: RESOURCE_EXHAUSTED
  // Prompt tokens of the requests waiting at most (what their prefills will cost): a request
  // that would pass it is refused RESOURCE_EXHAUSTED, unless nothing waits. 0: no limit.
  int64_t max_queued_prompt_tokens = 0;
  int64_t prefill_budget_tokens = 256;  // prompt tokens a step may carry beside its decodes
  // Admission by device memory: each running sequence holds what the KV cache and its policy
  // say a sequence of (prompt + max_new_tokens) tokens takes of the backend's memory
  // (KvCache::BackendBytesFor: staging, resident dense layers; KvSelectionPolicy::
  // BackendBytesFor: InfiniGen's partial keys), plus device_bytes_per_token per token for
  // anything else; what the cache keeps for reuse (KvCache::SpareBackendBytes) counts too until
  // it is released for a new sequence. Requests wait while the sum would pass
  // device_memory_bytes, and one that could never fit is refused with RESOURCE_EXHAUSTED.
  // 0 bytes: no limit.
  size_t device_bytes_per_token = 0;
  size_t device_memory_bytes = 0;
  // The same for host memory, by what the cache and the policy say a sequence holds there
  // besides the backend's memory (KvCache::HostBytesFor, KvSelectionPolicy::HostBytesFor: slot
  // lists, bounce buffers, a host policy's partial keys). 0: no limit.
  size_t host_memory_bytes = 0;
  // Conversations (EngineRequest::session_id) whose KV stays in a shared cache (the KV store)
  // after a request, so that the next turn prefills only its new tokens: at most this many,
  // each for at most session_ttl after its last request; the least recently used goes first
  // when a running sequence needs the room. 0: none kept.
  int max_sessions = 64;
  absl::Duration session_ttl = absl::Minutes(10);
  absl::Status Validate() const;
};

struct EngineRequest {
  std::vector<int32_t> prompt;
  // Tokens this request already produced elsewhere (a resumed stream): they extend the prompt,
  // count against max_new_tokens, and keep the sampling positions, so the continuation is the
  // one the first worker would have produced.
  std::vector<int32_t> resume_tokens;
  // Where the worker that produced resume_tokens stored this sequence's KV (its KvCache::Home),
  // 0: none. The engine then takes those rows over (KvCache::Attach) instead of prefilling the
  // prompt and resumed tokens again, and rebuilds the policy's state from the stored keys; if
  // the cache no longer has them, it replays (prefills) as without.
  uint64_t attach_home = 0;
  // A conversation: when the request ends well its KV stays in the cache (a cache with a Home:
  // the KV store), and the session's next request whose prompt begins with the same tokens
  // takes it over and prefills only the rest (usage: cached_tokens). Empty: none.
  std::string session_id;
  // The id (Submit's) of an earlier request with the same prompt whose prefill this one shares
  // (the samples of a request with n > 1), 0: none. It waits for that prefill, starts from a
  // copy of its KV (KvCache::Fork) and draws its first token from that request's last prompt
  // logits, computing nothing of the prompt; where the cache cannot copy, or that request ended
  // before its prefill did, it prefills its prompt itself.
  uint64_t prefill_from = 0;
  GenerateOptions options;
  std::unique_ptr<KvSelectionPolicy> policy;  // null: dense attention
  // What the text must be (structured output), already past resume_tokens; null: anything.
  // The sequence ends (FinishReason::kStop, no stop token) once it is whole.
  std::unique_ptr<TokenConstraint> constraint;
  absl::Time deadline = absl::InfiniteFuture();
};

struct RequestUsage {
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int64_t cached_tokens = 0;  // prompt and resumed tokens taken over, not recomputed
  bool attached = false;      // continued from another worker's stored KV (attach_home)
  FetchCounters fetch;
  double queue_seconds = 0;        // submitted -> first step
  double time_to_first_token = 0;  // submitted -> first token
  double decode_seconds = 0;       // first token -> last token
};

// One token, or the end of the request (done), or both.
struct EngineEvent {
  int32_t token = -1;     // -1: none in this event
  uint64_t home = 0;      // with the first token: where other workers find the KV (KvCache::Home)
  bool attached = false;  // with the first token: the KV was taken over (attach_home)
  // With each token when the request asked for them (GenerateOptions::logprobs >= 0).
  bool has_logprobs = false;
  TokenLogprobs logprobs;
  // With the first token when the request asked for them (GenerateOptions::prompt_logprobs >=
  // 0): one entry per prompt token after the first, in order.
  bool has_prompt_logprobs = false;
  std::vector<TokenLogprobs> prompt_logprobs;
  bool done = false;
  FinishReason finish_reason = FinishReason::kLength;
  int32_t stop_token = -1;  // when done with kStop: the EOS or stop token that ended it
  absl::Status status;      // when done: OK, or why the request failed
  RequestUsage usage;       // when done
};
using EventSink = std::function<void(const EngineEvent&)>;

struct EngineStats {
  int64_t running = 0;
  int64_t queued = 0;
  int64_t steps = 0;
  int64_t generated_tokens = 0;
  int64_t prompt_tokens = 0;
  int64_t finished = 0;
  int64_t failed = 0;
  int64_t last_batch_sequences = 0;
  double gather_wait_seconds = 0;
  int64_t bytes_fetched = 0;
  int64_t bytes_full = 0;
  int64_t bytes_reused = 0;       // read where a device kept them (FetchCounters::bytes_reused)
  int64_t kv_pool_evictions = 0;  // tokens a KV pool evicted (finished requests)
  // Decode steps whose selection was among the rows prefetched during the previous layer, and
  // those that fetched again (DecodeStep::prefetch_hits).
  int64_t prefetch_hits = 0;
  int64_t prefetch_misses = 0;
  StepProfile decode_profile;  // where decode-only steps spent their time (DecodeStep::profile)
};

class BatchEngine {
 public:
  // `model` and `cache` must outlive the engine; only the engine thread touches them.
  BatchEngine(Model& model, KvCache& cache, const EngineConfig& config);
  ~BatchEngine();  // finishes every request as CANCELLED (status ABORTED) and joins the thread

  // Queues a request; `sink` gets its events. INVALID_ARGUMENT for bad options (naming the
  // field), RESOURCE_EXHAUSTED when the queue is full. Returns the request's id.
  absl::StatusOr<uint64_t> Submit(EngineRequest request, EventSink sink);
  // Ends a request at the next step boundary (finish reason CANCELLED); unknown ids are ignored.
  void Cancel(uint64_t id);
  EngineStats Stats() const;
  // Stats().decode_profile counts the decode-only steps of at least `n` sequences from now on
  // (DecodeStep::set_profile_min_batch; benchmarks).
  void ProfileStepsOfAtLeast(int64_t n) { step_.set_profile_min_batch(n); }

 private:
  struct Active {
    uint64_t id = 0;
    EngineRequest request;
    EventSink sink;
    std::vector<int32_t> history;  // prompt, resumed and generated tokens
    std::vector<int32_t> stops;
    int64_t prompt_len = 0;   // prompt + resumed tokens: what prefill covers
    int64_t prefilled = 0;    // tokens of history in the cache
    int64_t generated = 0;    // tokens sampled here (resumed ones not included)
    int64_t max_total = 0;    // history length at which the length limit ends the request
    int64_t cached = 0;       // tokens of history taken over from another worker's KV
    int32_t stop_token = -1;  // the token that ended it (kStop)
    bool attached = false;
    bool opened = false;
    // Prompt logprobs asked for and computed here: not a resumed stream (whose first worker
    // sent them); the prompt's chunks then produce every row's logits.
    bool prompt_logprobs = false;
    std::vector<TokenLogprobs> prompt_logprobs_so_far;
    size_t device_bytes = 0;  // reserved against config_.device_memory_bytes while running
    size_t host_bytes = 0;    // ... and against config_.host_memory_bytes
    bool follows = false;     // counted in followers_ (request.prefill_from) until it opens
    // A copy of its leader's whole prompt: the logits its first token is drawn from (the
    // leader's last prompt row), used by the next step instead of a forward pass.
    std::vector<float> first_logits;
    absl::Time submitted, first_step, first_token, last_token;
    bool started = false;
  };

  void Loop();
  void Admit(std::vector<std::unique_ptr<Active>>& incoming);
  // Opens a's sequence in the cache: takes over its session's or another worker's stored KV
  // where it can (setting a.prefilled, a.cached), else opens it empty; closes least recently
  // used sessions while the cache is full.
  absl::Status OpenSequence(Active& a);
  // Where the request whose prefill `a` shares (request.prefill_from) stands: still before the
  // end of its prefill, done with it (running or parked: Fork copies it), or gone.
  enum class Leader { kPrefilling, kReady, kGone };
  Leader LeaderOf(const Active& a, const std::vector<std::unique_ptr<Active>>& incoming);
  // `a` no longer waits for its leader (opened, or finished): the last follower of a parked
  // leader closes it.
  void Unfollow(Active& a);
  bool Step();  // false when there was nothing to run
  // Samples a's next token from `row` (its logits, which sampling changes) and sends it; ends
  // the request at a stop token or its length.
  void Emit(Active& a, std::span<float> row);
  // A request for no new tokens (max_new_tokens 0) whose prompt is computed: an event without a
  // token (its prompt logprobs), then its end (finish reason length).
  void EmitPromptOnly(Active& a);
  void Finish(Active& a, FinishReason reason, absl::Status status);

  Model& model_;
  KvCache& cache_;
  const EngineConfig config_;

  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<Active>> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_prompt_tokens_ ABSL_GUARDED_BY(mu_) = 0;  // of the requests in queue_
  absl::flat_hash_set<uint64_t> cancelled_ ABSL_GUARDED_BY(mu_);
  // Requests whose prefill others share: how many of those have not opened yet.
  absl::flat_hash_map<uint64_t, int> followers_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;  // submitted, not finished
  EngineStats stats_ ABSL_GUARDED_BY(mu_);

  // Engine thread only.
  DecodeStep step_;
  std::vector<std::unique_ptr<Active>> running_;
  // Finished requests whose sequence stays open for followers still to copy it: id -> the tokens
  // its KV holds.
  absl::flat_hash_map<uint64_t, std::vector<int32_t>> parked_;
  // The logits of the last prompt token of requests whose prefill others share, while they wait:
  // a copy of the whole prompt draws its first token from them, as a prefill would have.
  absl::flat_hash_map<uint64_t, std::vector<float>> prompt_logits_;
  std::vector<float> logits_;
  std::vector<float> raw_row_;  // a token's logits before sampling changes them (logprobs)
  size_t device_bytes_reserved_ = 0;
  size_t host_bytes_reserved_ = 0;
  SessionTable sessions_;
  SamplingScratch scratch_;
  std::thread thread_;
};

}  // namespace infinigen
