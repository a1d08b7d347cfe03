#include "gpu_worker/engine/batch_engine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace infinigen {
namespace {

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

}  // namespace

absl::Status EngineConfig::Validate() const {
  if (max_running < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_running must be >= 1, got ", max_running));
  }
  if (max_queued < 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_queued must be >= 0, got ", max_queued));
  }
  if (max_queued_prompt_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_queued_prompt_tokens must be >= 0, got ", max_queued_prompt_tokens));
  }
  if (max_sessions < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_sessions must be >= 0, got ", max_sessions));
  }
  if (prefill_budget_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_budget_tokens must be >= 1, got ", prefill_budget_tokens));
  }
  return absl::OkStatus();
}

BatchEngine::BatchEngine(Model& model, KvCache& cache, const EngineConfig& config)
    : model_(model),
      cache_(cache),
      config_(config),
      step_(model, cache),
      sessions_(cache, config.max_sessions, config.session_ttl) {
  thread_ = std::thread([this] { Loop(); });
}

BatchEngine::~BatchEngine() {
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

absl::StatusOr<uint64_t> BatchEngine::Submit(EngineRequest request, EventSink sink) {
  IG_RETURN_IF_ERROR(request.options.Validate());
  const ModelConfig& c = model_.config();
  IG_RETURN_IF_ERROR(
      request.options.ValidateForModel(request.prompt, c.vocab_size, c.max_position_embeddings));
  IG_RETURN_IF_ERROR(CheckTokenIds(request.resume_tokens, c.vocab_size));
  const int64_t resumed = static_cast<int64_t>(request.resume_tokens.size());
  if (resumed > request.options.max_new_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        resumed, " resumed tokens exceed max_new_tokens ", request.options.max_new_tokens));
  }
  const int64_t total =
      static_cast<int64_t>(request.prompt.size()) + request.options.max_new_tokens;
  size_t device_bytes =
      config_.device_bytes_per_token * static_cast<size_t>(total) + cache_.BackendBytesFor(total);
  size_t host_bytes = cache_.HostBytesFor(total);
  if (request.policy != nullptr) {
    device_bytes += request.policy->BackendBytesFor(total);
    host_bytes += request.policy->HostBytesFor(total);
  }
  if (config_.host_memory_bytes > 0 && host_bytes > config_.host_memory_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the request needs about ", host_bytes >> 20, " MiB of host memory for ",
                     total, " tokens; this worker admits ", config_.host_memory_bytes >> 20,
                     " MiB: use fewer prompt or new tokens"));
  }
  if (config_.device_memory_bytes > 0 && device_bytes > config_.device_memory_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the request needs about ", device_bytes >> 20, " MiB of device memory for ",
                     total, " tokens; this worker has ", config_.device_memory_bytes >> 20,
                     " MiB: use fewer prompt or new tokens"));
  }
  auto a = std::make_unique<Active>();
  a->device_bytes = device_bytes;
  a->host_bytes = host_bytes;
  a->history = request.prompt;
  a->history.insert(a->history.end(), request.resume_tokens.begin(), request.resume_tokens.end());
  a->prompt_len = static_cast<int64_t>(a->history.size());
  a->prompt_logprobs = request.options.prompt_logprobs >= 0 && request.resume_tokens.empty() &&
                       request.attach_home == 0;
  a->max_total = total;
  a->stops = request.options.stop_token_ids;
  if (!request.options.ignore_eos) {
    a->stops.insert(a->stops.end(), c.eos_token_ids.begin(), c.eos_token_ids.end());
  }
  a->request = std::move(request);
  a->sink = std::move(sink);
  a->submitted = absl::Now();
  absl::MutexLock l(&mu_);
  if (stopping_) return absl::UnavailableError("the engine is shutting down");
  if (outstanding_ >= config_.max_queued + config_.max_running) {
    return absl::ResourceExhaustedError(absl::StrCat("the worker is full: ", config_.max_running,
                                                     " requests run and ", config_.max_queued,
                                                     " wait; retry later or on another worker"));
  }
  if (config_.max_queued_prompt_tokens > 0 && !queue_.empty() &&
      queued_prompt_tokens_ + a->prompt_len > config_.max_queued_prompt_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the worker's queue holds ", queued_prompt_tokens_, " prompt tokens and this request has ",
        a->prompt_len, "; the limit (max_queued_prompt_tokens) is ",
        config_.max_queued_prompt_tokens, "; retry later or on another worker"));
  }
  if (a->request.prefill_from != 0) {
    if (a->request.prefill_from >= next_id_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prefill_from names request ", a->request.prefill_from, ", not submitted before"));
    }
    a->follows = true;
    ++followers_[a->request.prefill_from];
  }
  ++outstanding_;
  a->id = next_id_++;
  const uint64_t id = a->id;
  queued_prompt_tokens_ += a->prompt_len;
  queue_.push_back(std::move(a));
  stats_.queued = static_cast<int64_t>(queue_.size());
  return id;
}

void BatchEngine::Cancel(uint64_t id) {
  absl::MutexLock l(&mu_);
  cancelled_.insert(id);
}

EngineStats BatchEngine::Stats() const {
  absl::MutexLock l(&mu_);
  return stats_;
}

void BatchEngine::Finish(Active& a, FinishReason reason, absl::Status status) {
  EngineEvent e;
  e.done = true;
  e.finish_reason = reason;
  e.stop_token = reason == FinishReason::kStop ? a.stop_token : -1;
  e.status = std::move(status);
  RequestUsage& u = e.usage;
  u.prompt_tokens = static_cast<int64_t>(a.request.prompt.size());
  u.generated_tokens = static_cast<int64_t>(a.history.size()) - u.prompt_tokens;
  u.cached_tokens = a.cached;
  u.attached = a.attached;
  if (a.opened) {
    u.fetch = cache_.Counters(a.id);
    const bool keep = e.status.ok() && reason != FinishReason::kCancelled &&
                      !a.request.session_id.empty() && config_.max_sessions > 0 &&
                      cache_.Home(a.id) != 0;
    // A request that failed the way the router continues elsewhere (the KV cache lost or could
    // not reach rows: ABORTED, UNAVAILABLE; the worker shutting down) leaves its stored KV for
    // the next worker to take over instead of deleting it.
    const bool resumable =
        (absl::IsAborted(e.status) || absl::IsUnavailable(e.status)) && cache_.Home(a.id) != 0;
    bool followed = false;
    if (!keep && !resumable && a.prefilled >= a.prompt_len) {
      absl::MutexLock l(&mu_);
      auto f = followers_.find(a.id);
      followed = f != followers_.end() && f->second > 0;
    }
    if (followed || keep) cache_.Idle(a.id);  // its device memory is no longer reserved
    if (followed) {                           // samples of the same prompt still to copy its KV
      parked_.emplace(a.id,
                      std::vector<int32_t>(a.history.begin(), a.history.begin() + a.prefilled));
    } else if (keep) {  // the conversation's next request continues from this KV
      sessions_.Keep(a.request.session_id, a.id,
                     std::vector<int32_t>(a.history.begin(), a.history.begin() + a.prefilled),
                     absl::Now());
    } else if (resumable) {
      cache_.Release(a.id);
    } else {
      cache_.Close(a.id);
    }
    a.opened = false;
    device_bytes_reserved_ -= a.device_bytes;
    host_bytes_reserved_ -= a.host_bytes;
  }
  if (a.request.policy != nullptr) a.request.policy->Release(a.id);
  Unfollow(a);
  const absl::Time now = absl::Now();
  u.queue_seconds = a.started ? Seconds(a.first_step - a.submitted) : Seconds(now - a.submitted);
  if (a.generated > 0) {
    u.time_to_first_token = Seconds(a.first_token - a.submitted);
    u.decode_seconds = Seconds(a.last_token - a.first_token);
  }
  {
    absl::MutexLock l(&mu_);
    --outstanding_;
    stats_.finished += e.status.ok() ? 1 : 0;
    stats_.failed += e.status.ok() ? 0 : 1;
    stats_.gather_wait_seconds += u.fetch.wait_seconds;
    stats_.bytes_fetched += u.fetch.bytes_fetched;
    stats_.bytes_full += u.fetch.bytes_full;
    stats_.bytes_reused += u.fetch.bytes_reused;
    stats_.kv_pool_evictions += u.fetch.evictions;
  }
  if (a.sink) a.sink(e);
  a.sink = nullptr;  // marks it finished
}

BatchEngine::Leader BatchEngine::LeaderOf(const Active& a,
                                          const std::vector<std::unique_ptr<Active>>& incoming) {
  const uint64_t id = a.request.prefill_from;
  if (parked_.contains(id)) return Leader::kReady;
  for (const auto& r : running_) {
    if (r->id == id) return r->prefilled >= r->prompt_len ? Leader::kReady : Leader::kPrefilling;
  }
  for (const auto& r : incoming) {
    if (r != nullptr && r->id == id) return Leader::kPrefilling;
  }
  absl::MutexLock l(&mu_);
  for (const auto& r : queue_) {
    if (r->id == id) return Leader::kPrefilling;
  }
  return Leader::kGone;
}

void BatchEngine::Unfollow(Active& a) {
  if (!a.follows) return;
  a.follows = false;
  const uint64_t leader = a.request.prefill_from;
  {
    absl::MutexLock l(&mu_);
    auto f = followers_.find(leader);
    if (f == followers_.end() || --f->second > 0) return;
    followers_.erase(f);
  }
  prompt_logits_.erase(leader);
  if (parked_.erase(leader) > 0) cache_.Close(leader);
}

void BatchEngine::Admit(std::vector<std::unique_ptr<Active>>& incoming) {
  std::vector<std::unique_ptr<Active>> waiting;  // samples whose shared prefill is not done yet
  for (size_t i = 0; i < incoming.size(); ++i) {
    Active& a = *incoming[i];
    if (a.follows && LeaderOf(a, incoming) == Leader::kPrefilling) {
      waiting.push_back(std::move(incoming[i]));
      continue;
    }
    // A resumed stream with nothing left to generate ends here (a prompt-only request,
    // max_new_tokens 0, computes its prompt).
    if (!a.request.resume_tokens.empty() &&
        a.request.options.max_new_tokens == static_cast<int64_t>(a.request.resume_tokens.size())) {
      Finish(a, FinishReason::kLength, absl::OkStatus());
      continue;
    }
    absl::Status st;
    // What the cache keeps for reuse counts as held; it goes when a new sequence needs room.
    const size_t limit = config_.device_memory_bytes;
    if (limit > 0 && device_bytes_reserved_ + a.device_bytes + cache_.SpareBackendBytes() > limit) {
      cache_.ReleaseSpares();
    }
    if (limit > 0 && device_bytes_reserved_ + a.device_bytes + cache_.SpareBackendBytes() > limit) {
      st = absl::ResourceExhaustedError("device memory");  // running sequences hold it
    } else if (config_.host_memory_bytes > 0 &&
               host_bytes_reserved_ + a.host_bytes > config_.host_memory_bytes) {
      st = absl::ResourceExhaustedError("host memory");
    } else {
      st = OpenSequence(a);
    }
    if (absl::IsResourceExhausted(st) && !running_.empty()) {
      // Not now: wait for running sequences to free memory, keeping the order.
      absl::MutexLock l(&mu_);
      for (size_t j = incoming.size(); j > i; --j) {
        if (incoming[j - 1] == nullptr) continue;  // moved to `waiting`
        queued_prompt_tokens_ += incoming[j - 1]->prompt_len;
        queue_.push_front(std::move(incoming[j - 1]));
      }
      incoming.resize(i);
      break;
    }
    if (!st.ok()) {
      Finish(a, FinishReason::kCancelled, st);
      continue;
    }
    a.opened = true;
    Unfollow(a);
    device_bytes_reserved_ += a.device_bytes;
    host_bytes_reserved_ += a.host_bytes;
    if (a.request.policy != nullptr) {
      a.request.policy->Open(a.id, a.max_total);
      if (a.cached > 0) st = step_.Restore(a.id, *a.request.policy, a.cached);
      if (!st.ok()) {
        Finish(a, FinishReason::kCancelled, st);
        continue;
      }
    }
    running_.push_back(std::move(incoming[i]));
  }
  // Back to the head of the queue, in their order, for the next step.
  absl::MutexLock l(&mu_);
  for (auto it = waiting.rbegin(); it != waiting.rend(); ++it) {
    queued_prompt_tokens_ += (*it)->prompt_len;
    queue_.push_front(std::move(*it));
  }
}

absl::Status BatchEngine::OpenSequence(Active& a) {
  // Stored KV to take over: another worker's (a resumed stream), or this session's previous
  // request's, as far as its tokens are this prompt's; always all but the last token (this step
  // computes it for the next logits).
  uint64_t home = a.request.attach_home;
  int64_t keep = a.prompt_len - 1;
  if (a.follows && !a.prompt_logprobs) {  // a copy of the leader's KV, as far as it is ours
    const uint64_t leader = a.request.prefill_from;
    std::span<const int32_t> held;
    if (auto p = parked_.find(leader); p != parked_.end()) held = p->second;
    for (const auto& r : running_) {
      if (r->id == leader) held = std::span<const int32_t>(r->history.data(), r->prefilled);
    }
    // The whole prompt when the leader's last prompt logits are at hand (the first token is
    // drawn from them), else all but its last token (computed here for the next logits).
    const auto logits = prompt_logits_.find(leader);
    const int64_t want = logits != prompt_logits_.end() ? a.prompt_len : keep;
    int64_t common = 0;
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(held.size()), want);
    while (common < n && held[common] == a.history[common]) ++common;
    if (common > 0) {
      absl::StatusOr<int64_t> copied = cache_.Fork(a.id, leader, common, a.max_total);
      if (copied.ok()) {
        a.prefilled = a.cached = *copied;
        if (*copied == a.prompt_len) a.first_logits = logits->second;
        return absl::OkStatus();
      }
      if (!absl::IsUnimplemented(copied.status())) {
        std::fprintf(stderr, "engine: request %llu: KV of request %llu not copied (%s); %s\n",
                     static_cast<unsigned long long>(a.id), static_cast<unsigned long long>(leader),
                     std::string(copied.status().ToString()).c_str(), "prefilling the prompt");
      }
    }
  }
  SequenceId parked = 0;  // the session's sequence, closed unless taken over
  if (home == 0 && !a.request.session_id.empty()) {
    SessionTable::Kept had = sessions_.Take(a.request.session_id);
    if (had.seq != 0) {
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(had.tokens.size()), keep);
      int64_t common = 0;
      while (common < n && had.tokens[common] == a.history[common]) ++common;
      parked = had.seq;
      keep = a.prompt_logprobs ? 0 : common;  // prompt logprobs: every prompt token computed
      if (keep > 0) home = cache_.Home(parked);
    }
  }
  // Idle sessions give way to the room this sequence will fill (the store allocates as rows
  // arrive, so a full store would fail it mid-stream): least recently used first.
  if (!sessions_.empty()) {
    const int64_t tokens = home != 0 ? a.max_total - keep : a.max_total;
    for (absl::StatusOr<bool> room = cache_.HasRoomFor(tokens);
         room.ok() && !*room && sessions_.CloseLeastRecent(); room = cache_.HasRoomFor(tokens)) {
    }
  }
  absl::Status st;
  for (;;) {
    if (home != 0) {
      absl::StatusOr<int64_t> kept = cache_.Attach(a.id, home, keep, a.max_total);
      if (kept.ok()) {
        a.attached = a.request.attach_home != 0;
        a.prefilled = a.cached = *kept;
        return absl::OkStatus();  // the session's sequence is now a's
      }
      // A resumed stream whose stored KV exists but could not be taken over now (the store
      // unreachable, slow): fail the call, so that the router tries the resume again (on this
      // worker or another) instead of recomputing what the store still holds.
      if (a.request.attach_home != 0 && !absl::IsNotFound(kept.status()) &&
          !absl::IsFailedPrecondition(kept.status()) && !absl::IsInvalidArgument(kept.status())) {
        return absl::UnavailableError(absl::StrCat("the stored KV of the resumed stream could not ",
                                                   "be taken over (", kept.status().message(),
                                                   "): retry the resume"));
      }
      // Gone (its lease lapsed, another store) or not resumable here (another shape, a KV
      // pool's): compute it. Said in the log, as the stream's resume becomes a replay.
      std::fprintf(stderr, "engine: request %llu: stored KV %llu not taken over (%s); %s\n",
                   static_cast<unsigned long long>(a.id), static_cast<unsigned long long>(home),
                   std::string(kept.status().ToString()).c_str(),
                   a.request.attach_home != 0 ? "replaying the stream" : "prefilling the prompt");
      home = 0;
    }
    st = cache_.Open(a.id, a.max_total);
    // Full: the least recently used idle session makes room, never a running sequence.
    if (!absl::IsResourceExhausted(st) || !sessions_.CloseLeastRecent()) break;
  }
  if (parked != 0) cache_.Close(parked);
  return st;
}

void BatchEngine::Loop() {
  for (;;) {
    std::vector<std::unique_ptr<Active>> incoming, dropped;
    absl::flat_hash_set<uint64_t> cancelled;
    {
      absl::MutexLock l(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queue_.empty() || !running_.empty() || !cancelled_.empty();
      };
      if (sessions_.empty()) {
        mu_.Await(absl::Condition(&ready));
      } else {  // wake up now and then to close sessions past their TTL
        mu_.AwaitWithTimeout(absl::Condition(&ready),
                             std::clamp(sessions_.ttl(), absl::Milliseconds(10), absl::Seconds(1)));
      }
      if (stopping_) break;
      cancelled.swap(cancelled_);
      // Queued requests that were cancelled or ran out of time leave without a batch slot.
      const absl::Time now = absl::Now();
      for (auto it = queue_.begin(); it != queue_.end();) {
        if (cancelled.contains((*it)->id) || now > (*it)->request.deadline) {
          queued_prompt_tokens_ -= (*it)->prompt_len;
          dropped.push_back(std::move(*it));
          it = queue_.erase(it);
        } else {
          ++it;
        }
      }
      while (!queue_.empty() &&
             static_cast<int64_t>(running_.size() + incoming.size()) < config_.max_running) {
        queued_prompt_tokens_ -= queue_.front()->prompt_len;
        incoming.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
    for (auto& a : dropped) {
      if (cancelled.contains(a->id)) {
        Finish(*a, FinishReason::kCancelled, absl::OkStatus());
      } else {
        Finish(*a, FinishReason::kCancelled,
               absl::DeadlineExceededError("the request's deadline passed while it was queued"));
      }
    }
    const absl::Time now = absl::Now();
    for (auto& a : running_) {
      if (cancelled.contains(a->id)) {
        Finish(*a, FinishReason::kCancelled, absl::OkStatus());
      } else if (now > a->request.deadline) {
        Finish(*a, FinishReason::kCancelled,
               absl::DeadlineExceededError(absl::StrCat("the request's deadline passed after ",
                                                        a->generated, " generated tokens")));
      }
    }
    std::erase_if(running_, [](const auto& a) { return !a->sink; });
    if (!sessions_.empty()) sessions_.Expire(absl::Now());
    Admit(incoming);
    Step();
    std::erase_if(running_, [](const auto& a) { return !a->sink; });
    absl::MutexLock l(&mu_);
    stats_.running = static_cast<int64_t>(running_.size());
    stats_.queued = static_cast<int64_t>(queue_.size());
  }
  // Shutting down: every request ends.
  std::deque<std::unique_ptr<Active>> queued;
  {
    absl::MutexLock l(&mu_);
    queued.swap(queue_);
    queued_prompt_tokens_ = 0;
  }
  for (auto& a : running_) {
    Finish(*a, FinishReason::kCancelled, absl::AbortedError("the worker is shutting down"));
  }
  for (auto& a : queued) {
    Finish(*a, FinishReason::kCancelled, absl::AbortedError("the worker is shutting down"));
  }
  running_.clear();
  sessions_.CloseAll();
  for (const auto& [id, tokens] : parked_) cache_.Close(id);
  parked_.clear();
  prompt_logits_.clear();
}

bool BatchEngine::Step() {
  // Copies of a whole prompt draw their first token from its last row's logits, as a prefill
  // of their own would have (no forward pass: the prompt's KV is theirs already).
  int64_t drawn = 0;
  for (auto& a : running_) {
    if (a->first_logits.empty() || !a->sink) continue;
    std::vector<float> row = std::move(a->first_logits);
    a->first_logits.clear();
    if (!a->started) {
      a->started = true;
      a->first_step = absl::Now();
    }
    Emit(*a, row);
    ++drawn;
  }
  std::vector<ForwardChunk> batch;
  std::vector<Active*> owners;
  for (auto& a : running_) {  // one decode token of every sequence past its prompt
    if (a->prefilled < a->prompt_len || !a->sink) continue;
    batch.push_back({a->id, a->prefilled,
                     std::span<const int32_t>(a->history.data() + a->prefilled, 1), false,
                     a->request.policy.get()});
    owners.push_back(a.get());
  }
  int64_t budget = config_.prefill_budget_tokens;
  for (auto& a : running_) {  // then prompt chunks, oldest request first, within the budget
    if (a->prefilled >= a->prompt_len || budget <= 0 || !a->sink) continue;
    const int64_t len = std::min(a->prompt_len - a->prefilled, budget);
    batch.push_back({a->id, a->prefilled,
                     std::span<const int32_t>(a->history.data() + a->prefilled, len),
                     /*all_logits=*/a->prompt_logprobs, a->request.policy.get()});
    owners.push_back(a.get());
    budget -= len;
  }
  if (batch.empty()) {
    absl::MutexLock l(&mu_);
    stats_.generated_tokens += drawn;
    return drawn > 0;
  }
  const absl::Time t0 = absl::Now();
  for (Active* a : owners) {
    if (!a->started) {
      a->started = true;
      a->first_step = t0;
    }
  }
  const int64_t vocab = model_.config().vocab_size;
  logits_.resize(static_cast<size_t>(DecodeStep::NumLogitRows(batch) * vocab));
  const absl::Status st = step_.Forward(batch, logits_);
  int64_t generated = drawn, prompt = 0;
  int64_t next_row = 0;  // chunk i's logit rows start here
  for (size_t i = 0; i < batch.size(); ++i) {
    Active& a = *owners[i];
    const int64_t len = static_cast<int64_t>(batch[i].tokens.size());
    const int64_t first_row = next_row;
    next_row += batch[i].all_logits ? len : 1;
    auto logit_row = [&](int64_t r) {
      return std::span<float>(logits_.data() + r * vocab, static_cast<size_t>(vocab));
    };
    // A failure of one sequence (its rows lost in the KV store, a fetch that timed out) ends
    // that sequence alone; a failure of the step ends every sequence in it.
    if (!st.ok() && (!step_.completed() || !step_.chunk_status(i).ok())) {
      Finish(a, FinishReason::kCancelled, step_.completed() ? step_.chunk_status(i) : st);
      continue;
    }
    if (len > 1 || a.prefilled < a.prompt_len) prompt += len;
    if (batch[i].all_logits) {  // row j: the distribution of the token after position start + j
      const int64_t prompt_size = static_cast<int64_t>(a.request.prompt.size());
      for (int64_t j = 0; j < len && batch[i].start + j + 1 < prompt_size; ++j) {
        ComputeLogprobs(logit_row(first_row + j), a.history[batch[i].start + j + 1],
                        a.request.options.prompt_logprobs, a.prompt_logprobs_so_far.emplace_back());
      }
    }
    a.prefilled += len;
    if (a.prefilled < static_cast<int64_t>(a.history.size())) continue;  // more prompt to go
    if (a.request.options.max_new_tokens == 0 && a.generated == 0) {     // the prompt only
      EmitPromptOnly(a);
      continue;
    }
    std::span<float> row = logit_row(next_row - 1);
    if (a.generated == 0) {  // its prompt's last row: kept for the samples that copy its KV
      bool followed;
      {
        absl::MutexLock l(&mu_);
        followed = followers_.contains(a.id);
      }
      if (followed) prompt_logits_[a.id].assign(row.begin(), row.end());
    }
    Emit(a, row);
    ++generated;
  }
  absl::MutexLock l(&mu_);
  stats_.steps += 1;
  stats_.generated_tokens += generated;
  stats_.prompt_tokens += prompt;
  stats_.last_batch_sequences = static_cast<int64_t>(batch.size());
  stats_.prefetch_hits = step_.prefetch_hits();
  stats_.prefetch_misses = step_.prefetch_misses();
  stats_.decode_profile = step_.profile();
  return true;
}

void BatchEngine::EmitPromptOnly(Active& a) {
  EngineEvent e;  // no token: where the KV lives, and the prompt's logprobs when asked
  e.home = cache_.Home(a.id);
  e.attached = a.attached;
  e.has_prompt_logprobs = a.prompt_logprobs;
  e.prompt_logprobs = std::move(a.prompt_logprobs_so_far);
  a.sink(e);
  Finish(a, FinishReason::kLength, absl::OkStatus());
}

void BatchEngine::Emit(Active& a, std::span<float> row) {
  const int64_t vocab = model_.config().vocab_size;
  const int logprobs = a.request.options.logprobs;
  if (logprobs >= 0) raw_row_.assign(row.begin(), row.end());  // sampling changes `row`
  for (const auto& [id, bias] : a.request.options.logit_bias) row[id] += bias;
  const int64_t produced = static_cast<int64_t>(a.history.size() - a.request.prompt.size());
  if (produced < a.request.options.min_tokens) {  // nothing may end it yet
    for (int32_t stop : a.stops) {
      if (stop >= 0 && stop < vocab) row[stop] = -INFINITY;
    }
  }
  TokenConstraint* constraint = a.request.constraint.get();
  if (constraint != nullptr && constraint->Complete()) {  // whole already (resumed so)
    a.stop_token = -1;
    Finish(a, FinishReason::kStop, absl::OkStatus());
    return;
  }
  if (constraint != nullptr && !constraint->Mask(row, a.stops)) {
    Finish(a, FinishReason::kCancelled,
           absl::FailedPreconditionError(
               "response_format: no token of the model's vocabulary continues the text"));
    return;
  }
  const int32_t token =
      SampleToken(row, a.request.options.sampling, a.history,
                  std::span<const int32_t>(a.history).subspan(a.request.prompt.size()),
                  static_cast<uint64_t>(a.history.size()), scratch_);
  if (constraint != nullptr && !constraint->Accept(token)) {  // a mask that let it through
    Finish(a, FinishReason::kCancelled,
           absl::InternalError(absl::StrCat("response_format: token ", token,
                                            " was drawn but does not continue the text")));
    return;
  }
  const absl::Time now = absl::Now();
  if (a.generated == 0) a.first_token = now;
  a.last_token = now;
  a.history.push_back(token);
  ++a.generated;
  EngineEvent e;
  e.token = token;
  if (logprobs >= 0) {
    e.has_logprobs = true;
    ComputeLogprobs(raw_row_, token, logprobs, e.logprobs);
  }
  if (a.generated == 1) {
    e.home = cache_.Home(a.id);
    e.attached = a.attached;
    e.has_prompt_logprobs = a.prompt_logprobs;
    e.prompt_logprobs = std::move(a.prompt_logprobs_so_far);
  }
  a.sink(e);
  if (std::find(a.stops.begin(), a.stops.end(), token) != a.stops.end()) {
    a.stop_token = token;
    Finish(a, FinishReason::kStop, absl::OkStatus());
  } else if (constraint != nullptr && constraint->Complete()) {  // the text is whole
    a.stop_token = -1;
    Finish(a, FinishReason::kStop, absl::OkStatus());
  } else if (static_cast<int64_t>(a.history.size()) >= a.max_total) {
    Finish(a, FinishReason::kLength, absl::OkStatus());
  }
}

}  // namespace infinigen
