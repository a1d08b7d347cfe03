// DecodeStep: one forward pass of a ragged batch (decode tokens and prefill chunks of several
// sequences) over a KV cache. The model runs the layers; this class owns everything about the
// K/V they attend to (INFINIGEN.md, "Decode step"):
//   - appends each layer's new K/V to the cache;
//   - speculation: during layer i-1 each speculating decode token's partial query of layer i
//     (Model::SpeculatePartialQuery, on its own compact rows);
//   - over a StreamedKvCache, the prefetch of layer i's rows during layer i-1: the candidates
//     the policy preselects from the speculation, or every stored row (dense layers, `full`);
//   - the exact selection at layer i (the policies), mapping it onto the prefetched rows (or
//     fetching what is missing), attention over them, and what was fetched (cache counters).
// A ResidentKvCache is read in place, by index; nothing is prefetched.
//
// Prefill chunks run through the same step (mixed batches); they attend densely.
//
// A failure that belongs to one sequence (its rows lost or late in the cache, its policy) fails
// that chunk alone: the step goes on without touching the chunk's cache or policy again, the
// other chunks' logits are exactly what they would have been (rows of a batch do not mix), and
// chunk_status(b) says what happened. Errors of the backend or the model fail the step.
// Not thread-safe: one engine thread owns a step, its model and its cache.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "gpu_worker/kv/kv_cache.h"
#include "gpu_worker/kv/kv_selection.h"
#include "gpu_worker/model/model.h"

namespace infinigen {

// Where the host time of decode-only steps went (steps whose every chunk is one decode token;
// prefills are not counted). On a GPU the host runs ahead of the device except where it waits (a
// copy to the host, a synchronize, a fetch), so a phase is its host work plus the waits in it,
// and what the phases leave of `total` is the model's own layers (their launches on a GPU).
struct StepProfile {
  int64_t steps = 0;
  int64_t layers = 0;       // layers those steps ran (steps x the model's layers)
  int64_t sequences = 0;    // sequences those steps decoded (their batches summed)
  double total = 0;         // seconds in Forward
  double speculate = 0;     // the next layer's partial queries
  double preselect = 0;     // the policies' guesses of the next layer's rows (and their copies)
  double prefetch = 0;      // handing rows to the cache to move (and refetching misses)
  double append = 0;        // storing the new tokens' K/V
  double select = 0;        // the policies' exact selection (and the copies they read)
  double fetch = 0;         // waiting for the fetched rows and placing them
  double fetch_wait = 0;    // of which waiting for the transport (the cache's wait_seconds)
  double attend = 0;        // decode attention over them
  BackendCounters backend;  // allocations, copies and synchronizations during those steps
};

struct ForwardChunk {
  SequenceId seq = 0;
  int64_t start = 0;                // tokens of `seq` already in the cache (= first position)
  std::span<const int32_t> tokens;  // the new tokens
  bool all_logits = false;          // logits of every new token, else of the last one only
  // Which rows decode steps of this sequence attend to; null = all (dense).
  KvSelectionPolicy* policy = nullptr;
};

class DecodeStep final : private LayerAttention {
 public:
  // `model` and `cache` must outlive the step; `cache` is a ResidentKvCache or a
  // StreamedKvCache (which one decides how rows are read, once, here).
  DecodeStep(Model& model, KvCache& cache);
  ~DecodeStep() override;

  Model& model() const { return model_; }
  KvCache& cache() const { return cache_; }

  // Logit rows that Forward writes for `batch`: per chunk, all its tokens or its last one.
  static int64_t NumLogitRows(std::span<const ForwardChunk> batch);

  // Runs `batch`, appending each chunk's K/V to the cache (the sequences must be open there),
  // and writes float32 logits [NumLogitRows(batch), vocab_size] to host memory `logits`, chunk
  // by chunk in order. Returns the step's failure (INVALID_ARGUMENT for out-of-range token ids
  // or positions; the backend's errors), else the first failed chunk's (chunk_status), else OK.
  absl::Status Forward(std::span<const ForwardChunk> batch, std::span<float> logits);
  // Whether the last Forward ran to its end: then the chunks with an OK chunk_status have their
  // logits, and only the others failed.
  bool completed() const { return completed_; }

  // A sequence whose first `length` tokens another worker stored (KvCache::Attach): hands their
  // keys, every layer, to `policy` as if this step had appended them (InfiniGen's partial key
  // cache, positions), one read of each layer and no model forward. The policy must be open
  // for `seq`; a policy that needs more than the keys (H2O's queries) is FAILED_PRECONDITION.
  absl::Status Restore(SequenceId seq, KvSelectionPolicy& policy, int64_t length);
  // Chunk b of the last Forward: OK; FAILED_PRECONDITION for a policy this cache or model
  // cannot serve, or more tokens than the cache holds; UNAVAILABLE / RESOURCE_EXHAUSTED when
  // the cache (the KV store) is unreachable or full; ABORTED when it lost this sequence's rows
  // or did not deliver them in time (another worker may continue it from what the client has);
  // or the policy's own error.
  const absl::Status& chunk_status(size_t b) const { return chunk_status_[b]; }

  // Decode steps whose selection was among the rows prefetched during the previous layer
  // (hits), and those that had to fetch again (misses). Streamed caches only.
  int64_t prefetch_hits() const { return prefetch_hits_; }
  int64_t prefetch_misses() const { return prefetch_misses_; }
  // Since the step was made: the decode-only steps of at least profile_min_batch() sequences.
  const StepProfile& profile() const { return profile_; }
  // A benchmark that wants its batch's steps alone (streams finish at different steps, and the
  // last ones decode alone) raises it; 1 (every decode-only step) by default.
  int64_t profile_min_batch() const { return profile_min_batch_.load(std::memory_order_relaxed); }
  void set_profile_min_batch(int64_t n) { profile_min_batch_.store(n, std::memory_order_relaxed); }

 private:
  // LayerAttention.
  absl::Status BeforeLayer(int layer, MatView attention_input, MatView residual) override;
  absl::Status Attend(int layer, MatView q, MatView k, MatView v, MatView out) override;

  // Checks every chunk's policy against this cache and model; sizes the workspaces.
  absl::Status Plan(std::span<const ForwardChunk> batch);
  // The speculated partial queries of `next_layer` for the speculating decode tokens, from
  // the current layer's attention input (or its residual under the next layer's norm).
  absl::Status Speculate(int next_layer, MatView attention_input, MatView residual);
  MatView SpeculatedRows(int layer) const;
  // Starts fetching, from a streamed cache, the rows of `next_layer` that each decode token will
  // read: the candidates its policy preselects from the speculation (INFINIGEN.md decode step
  // 6), or every stored row where it attends densely (no policy, a dense layer), so that a full
  // fetch overlaps the layer before too.
  absl::Status Prefetch(int next_layer);
  // Slots 0 .. stored-1 for each of `kv_heads` heads ([kv_heads, stored]): a dense read.
  static void EverySlot(int64_t kv_heads, int64_t stored, std::vector<int32_t>& out);
  // Gives chunk b's row lists (prefetched slots and maps, candidates, selection) room for
  // `entries` (every stored row of every KV head, and the current token's).
  void ReserveRowLists(size_t b, int64_t entries);
  absl::Status EnsureBuffer(std::unique_ptr<Buffer>& b, size_t bytes);
  // Float32 rows on the host, for the selection policies (which run there).
  struct HostRows {
    const float* data = nullptr;
    int64_t stride = 0;
    const float* Row(int64_t r) const { return data + r * stride; }
  };
  // `m` itself where the backend's memory is host floats; else a float32 copy of it in `host`
  // (converted on the device, then copied out; waits for the backend).
  absl::StatusOr<HostRows> ToHost(MatView m, std::vector<float>& host);
  // The same for several views at once: one copy and one wait for all of them.
  absl::Status ToHost(std::span<const MatView> views, std::span<HostRows*> out,
                      std::vector<float>& host);
  // Whether every row of `selection` (chunk b's, at the layer prefetched for it) is among the
  // prefetched candidates or is the current token (a selection of all rows: whether every row
  // was prefetched); fills the chunk's row map if so.
  // streamed_->Fetch, timed as the fetch phase.
  absl::StatusOr<KvLayerView> TimedFetch(SequenceId seq, int layer);
  bool MapPrefetched(size_t b, int layer, const Selection& selection, const int32_t* current_slots);
  struct Prefetched;
  bool Miss(Prefetched& pre);
  // Runs work(b) for every chunk b whose policy is set and that has not failed, failing the
  // chunks whose work fails: on the CPU kernels' team (kernels/cpu/team.h) when those chunks'
  // policies are distinct objects, in order otherwise. `work` calls only its chunk's policy and
  // writes only that chunk's state. (A FunctionRef, not a std::function: a capturing lambda would
  // be copied to the heap every layer.)
  void ForEachPolicy(absl::FunctionRef<absl::Status(size_t)> work);
  // Choices made in backend memory (policies that chooses_on_backend()) for some chunks of the
  // batch, launched one after another and read back in one copy that completes at the backend's
  // next wait: per chunk its count then its indices ([1 + kv_heads x capacity] int32 at at[b]).
  struct Choices {
    std::unique_ptr<Buffer> device;
    // A step planned on the device: the prefetch's choices alternate between device and this
    // by layer, for the kept rows' plan reads them on the side queue (StoreKvCache::
    // PrefetchOnDevice), which is joined only during the next layer, after that layer's
    // prefetch has launched its own choices.
    std::unique_ptr<Buffer> other;
    int device_layer = -1, other_layer = -1;  // the layer whose choice each last held
    std::vector<int32_t> host;
    std::vector<size_t> chunks;               // the chunks choosing (set by the caller)
    std::vector<int64_t> rows, at, capacity;  // per chunk of the batch (rows set by the caller)
    std::vector<BackendChoiceResult> result;  // what each did
    bool launched = false;                    // some chose: `host` fills at the next wait
  };
  // Launches c.chunks' choices of `layer` (their c.rows[b] rows each) and the copy of what they
  // chose (Backend::CopyToHostLater: no wait).
  absl::Status LaunchChoices(Choices& c, int layer, bool prefetch);
  // After the wait: each launched choice into out(b) (a Selection&); a chunk whose policy chose
  // nothing gets every row; a malformed count fails its chunk.
  void CollectChoices(Choices& c, absl::FunctionRef<Selection&(size_t)> out);
  // Prefetch's halves around the wait of Attend (or their own wait, for layer 0): the chunks'
  // stored rows and guesses, the backend's choices launched (PrefetchBegin); the choices read
  // and the cache's prefetches submitted (PrefetchEnd).
  absl::Status PrefetchBegin(int next_layer);
  absl::Status PrefetchEnd(int next_layer);
  bool ChoosesOnBackend(size_t b) const {
    return batch_[b].policy != nullptr && batch_[b].policy->chooses_on_backend();
  }
  bool Failed(size_t b) const { return !chunk_status_[b].ok(); }
  // A step planned on the device (decode_step_device_plan.cc): every decode token's policy
  // chooses in backend memory, over a cache that plans the rows of every layer those policies
  // choose at (StreamedKvCache::PlansOnDevice) and holds the step's appends until its end; a
  // prompt chunk beside them reads the rows stored before it apart from its own
  // (StreamedKvCache::ReadsStored). Then no choice is read on the host and nothing waits between
  // the layers: the one wait is the logits'. false also for a step without a decode token.
  bool DevicePlanFits(std::span<const ForwardChunk> batch) const;
  // Pass 2 of such a step for prompt chunk b (start > 0): the rows stored before it, read as
  // the store holds them, with the chunk's own K/V written after each head's.
  absl::StatusOr<KvLayerView> ReadPromptRows(size_t b, int layer, MatView k, MatView v);
  // PrefetchEnd's part for a step planned on the device: chunk b's rows of `next_layer` (its
  // choice where the backend launched one, else every stored row) started there; false when
  // the cache cannot plan them there (a dense layer longer than its kept rows): the host
  // prefetches them.
  absl::StatusOr<bool> PrefetchOnDevice(size_t b, int next_layer, int64_t stored);
  // Pass 2 of such a step for decode chunk b: its rows found where the device keeps them (its
  // choice mapped there, or every row), the current token's written after them, and its
  // attention queued over the count in backend memory. false: not prefetched on the device
  // (the host's path runs).
  absl::StatusOr<bool> AttendOnDevice(size_t b, int layer, MatView q, MatView k, MatView v,
                                      MatView out);
  // After the logits' wait: the held appends go to the store and each sequence's plans are
  // counted (a plan that did not fit fails its chunk).
  void EndDevicePlan();
  // Chunk b's choice of `layer` in backend memory, as the cache reads it.
  DeviceSlotList DeviceChoice(const Choices& c, size_t b) const;
  // The phase of profile_ to add a scope's time to; null when this step is not profiled.
  double* Timing(double StepProfile::*phase) { return profiling_ ? &(profile_.*phase) : nullptr; }
  // Chunk b fails with `status` (its first failure is kept).
  void Fail(size_t b, absl::Status status);
  // Chunk b fails because the cache could not store or read its rows at `layer` (NOT_FOUND
  // and DEADLINE_EXCEEDED become ABORTED; other codes are kept).
  void FailKv(size_t b, int layer, const absl::Status& status);
  // One decode token's attention over `rows` rows of `kv` (listed by device `indices`, or the
  // first `rows` when null): queued in decode_items_ for the batch's one call at the end of
  // pass 2, or, for policies that want the attention weights, run now and the weights handed
  // to them.
  absl::Status AttentionStep(size_t b, int layer, MatView q, const KvLayerView& kv,
                             const int32_t* indices, int64_t rows, const Selection& selection,
                             MatView out);

  Model& model_;
  KvCache& cache_;
  ResidentKvCache* resident_ = nullptr;  // exactly one of these is the cache
  StreamedKvCache* streamed_ = nullptr;

  // The step being run.
  std::span<const ForwardChunk> batch_;
  std::vector<ModelChunk> model_chunks_;
  int64_t num_tokens_ = 0;
  std::vector<int64_t> rows_;       // per chunk: its first row of the batch's activations
  std::vector<int64_t> spec_rows_;  // per chunk: its row of the speculation buffers, or -1
  int64_t num_spec_rows_ = 0;
  std::vector<int32_t> host_spec_positions_;

  // Workspaces (backend memory; grow only): the speculation's input, scratch and partial
  // queries of layer i in spec_q_[i % 2] (layer i-1 writes layer i's while its own is in use),
  // the positions of the speculating rows, the batch's decode row indices and attention weights.
  std::unique_ptr<Buffer> spec_in_, spec_scratch_, spec_q_[2], spec_positions_, indices_, weights_;
  // Float32 staging of activations the host policies read, on backends the host cannot read.
  std::unique_ptr<Buffer> mirror_;
  // The current token's K and V rows in the cache's dtype, per chunk ([batch, 2, kv_heads,
  // head_dim]), where the activations' dtype differs (the CPU's bf16 K/V): attention must read
  // the rows a later step (or a prefill) will read from the cache, not the unrounded activations.
  std::unique_ptr<Buffer> current_kv_;
  std::unique_ptr<Buffer> restore_;  // Restore's keys of one layer, float32 [tokens, kv_heads * d]
  std::vector<int32_t> host_slots_;  // [tokens, num_kv_heads] slots from the last Append
  std::vector<KvCache::LayerAppend> appends_;  // a layer's appends, one per chunk not failed
  std::vector<size_t> append_chunks_;          // ... their chunks
  std::vector<absl::Status> append_status_;    // ... and what each came to
  std::vector<float> host_weights_;
  std::vector<DecodeAttentionItem> decode_items_;  // a layer's decode attention, run together
  // A layer's row indices of every decode token ([kv_heads, rows] each, chunk b's from
  // index_at_[b], -1: none), copied to indices_ together.
  std::vector<int32_t> host_indices_;
  std::vector<int64_t> index_at_;
  std::vector<float> host_q_, host_k_, host_spec_q_;  // ToHost copies
  std::vector<Selection> selections_;  // per chunk of the current batch, at the current layer
  std::vector<int32_t> all_slots_;     // every slot, for dense reads of a streamed cache
  // Per layer parity and chunk: the candidate rows prefetched for a layer (-1: none),
  // [num_kv_heads, count]; layer i's are in use while layer i + 1's are being fetched.
  struct Prefetched {
    int layer = -1;
    int64_t count = 0;
    bool dense = false;      // every stored row (slots 0, 1, ...)
    bool on_device = false;  // planned there (PrefetchOnDevice): slots and map unused
    std::vector<int32_t> slots;
    std::vector<int32_t> map;  // the selection's rows as rows of the prefetched staging
  };
  std::vector<Prefetched> prefetched_[2];
  // Per chunk of the current batch, what the policy work of a layer (run in parallel) needs.
  struct ChunkWork {
    KvLayerView kv;      // the layer's stored rows as its policy may see them
    int64_t stored = 0;  // rows stored before this step (prefetch)
    bool fetch = false;  // the prefetch fetches for it
    Selection candidates;
  };
  std::vector<ChunkWork> chunks_;
  // The layer's own choices (select_) and the next layer's prefetch (preselect_), in flight
  // together until Attend's one wait.
  Choices select_, preselect_;
  std::vector<size_t> policy_chunks_;
  std::vector<absl::Status> statuses_;
  std::vector<absl::Status> chunk_status_;  // per chunk of the current batch
  bool completed_ = false;
  int64_t prefetch_hits_ = 0, prefetch_misses_ = 0;
  StepProfile profile_;
  bool profiling_ = false;  // the current batch is decode tokens only, and large enough
  std::atomic<int64_t> profile_min_batch_{1};
  bool speculating_ = false;  // some chunk of the current batch speculates
  bool device_plan_ = false;  // the current step is planned on the device (DevicePlanFits)
  std::vector<SequenceId> device_decodes_;  // ... its decode tokens' sequences
  int spec_layer_[2] = {-1, -1};            // the layer whose partial queries spec_q_[parity] holds
};

}  // namespace infinigen
