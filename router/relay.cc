#include "router/relay.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "frontend/request_validation.h"

namespace infinigen {

namespace wv1 = worker::v1;

bool RetriableOnAnotherWorker(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
      return true;
    default:
      return false;
  }
}

std::string RelayAction::DebugString() const {
  std::string s;
  switch (kind) {
    case Kind::kPick:
      s = "pick";
      break;
    case Kind::kCall:
      s = absl::StrCat("call ", worker);
      if (resume_tokens > 0) {
        absl::StrAppend(&s, " (resume ", resume_tokens, resume_tokens == 1 ? " token" : " tokens",
                        resume_store != 0 ? absl::StrCat(", store ", resume_store) : "", ")");
      }
      return s;
    case Kind::kWait:
      return absl::StrCat("wait ", absl::FormatDuration(wait));
    case Kind::kFinish:
      s = absl::StrCat("finish ", absl::StatusCodeToString(status.code()),
                       status.message().empty() ? "" : ": ", status.message());
      if (retry_pushback_ms > 0) absl::StrAppend(&s, " (retry in ", retry_pushback_ms, " ms)");
      break;
  }
  std::vector<std::string> notes;
  if (!failed.empty()) notes.push_back(absl::StrCat(failed, " failed"));
  if (stalled) notes.push_back("stalled");
  if (failover) notes.push_back("failover");
  if (!notes.empty()) absl::StrAppend(&s, " (", absl::StrJoin(notes, ", "), ")");
  return s;
}

std::string RelayForward::DebugString() const {
  const int n = message.token_ids_size();
  std::string s = absl::StrCat("forward ", n, n == 1 ? " token" : " tokens");
  std::vector<std::string> notes;
  if (!message.request_id().empty()) notes.push_back("id");
  if (first_tokens) notes.push_back("first");
  if (resumed) notes.push_back("resumed");
  if (message.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
    notes.push_back(
        absl::StrCat("final: failovers ", message.failovers(), ", resumes ", message.resumes()));
  }
  if (!notes.empty()) absl::StrAppend(&s, " (", absl::StrJoin(notes, ", "), ")");
  return s;
}

Relay::Relay(const RelayRules& rules, wv1::GenerateRequest request, int64_t budget,
             absl::Time client_deadline)
    : rules_(rules),
      request_(std::move(request)),
      budget_(budget),
      client_deadline_(client_deadline) {
  // Validated before (ValidateGenerateRequest): at most kMaxSamples.
  const int n = std::min(request_.sampling().n(), kMaxSamples);
  if (n > 1) samples_.resize(static_cast<size_t>(n));
}

RelayAction Relay::Start() { return RelayAction{}; }

std::vector<std::string> Relay::excluded() const {
  std::vector<std::string> out = failed_;
  out.insert(out.end(), full_.begin(), full_.end());
  return out;
}

int64_t Relay::expected_tokens() const {
  const int64_t samples = std::max(1, request_.sampling().n());
  return std::max<int64_t>(1, budget_ * samples - static_cast<int64_t>(sent_.size()));
}

RelayAction Relay::Picked(absl::string_view worker, absl::Time now) {
  if (worker.empty()) {
    // Every worker failed or is full. A stream under way waits for a worker (it cannot be handed
    // back); a request that has not started is refused so that the client can back off.
    const bool wait = forwarded_ && now < resume_deadline_ && now < client_deadline_;
    if (!wait) return Fail();
    RelayAction a;
    a.kind = RelayAction::Kind::kWait;
    a.wait = rules_.poll;
    return a;
  }
  current_ = std::string(worker);
  first_message_ = true;
  ++calls_;
  request_.clear_resume_token_ids();
  request_.clear_resumed_samples();
  if (samples_.empty()) {
    for (int32_t t : sent_) request_.add_resume_token_ids(t);
    request_.set_resume_store_sequence_id(sent_.empty() || !rules_.resume_from_store ? 0 : home_);
  } else if (!sent_.empty()) {  // several samples: each continues from what it sent
    for (size_t i = 0; i < samples_.size(); ++i) {
      const Sample& s = samples_[i];
      if (s.sent.empty() && !s.finished) continue;  // starts afresh
      wv1::ResumedSample* r = request_.add_resumed_samples();
      r->set_index(static_cast<int32_t>(i));
      for (int32_t t : s.sent) r->add_token_ids(t);
      r->set_store_sequence_id(rules_.resume_from_store ? s.home : 0);
      r->set_finished(s.finished);
    }
  }
  RelayAction a;
  a.kind = RelayAction::Kind::kCall;
  a.worker = current_;
  a.resume_tokens =
      samples_.empty() ? request_.resume_token_ids_size() : static_cast<int64_t>(sent_.size());
  a.resume_store = request_.resume_store_sequence_id();
  return a;
}

RelayAction Relay::Waited() {
  // Full workers may have room now, and failed ones may be back: placement offers a failed
  // worker again once the pool's health checks find it serving (a worker restarted, a link to
  // the store restored). max_attempts still bounds the failed calls.
  full_.clear();
  failed_.clear();
  return RelayAction{};
}

RelayForward Relay::Received(wv1::GenerateResponse m) {
  RelayForward f;
  Sample* sample = nullptr;  // of several
  if (!samples_.empty() && m.index() >= 0 && m.index() < static_cast<int>(samples_.size())) {
    sample = &samples_[static_cast<size_t>(m.index())];
  }
  if (m.store_sequence_id() != 0) {
    if (first_message_ && m.attached()) {
      ++resumes_;
      f.resumed = true;
    }
    home_ = m.store_sequence_id();
    if (sample != nullptr) sample->home = m.store_sequence_id();
  }
  if (sample != nullptr) {
    sample->sent.insert(sample->sent.end(), m.token_ids().begin(), m.token_ids().end());
    sample->finished = sample->finished || m.finish_reason() != v1::FINISH_REASON_UNSPECIFIED;
  }
  first_message_ = false;
  v1::GenerateResponse& out = f.message;
  out.mutable_token_ids()->Swap(m.mutable_token_ids());
  out.mutable_logprobs()->Swap(m.mutable_logprobs());
  if (!forwarded_) out.mutable_prompt_logprobs()->Swap(m.mutable_prompt_logprobs());
  out.set_text(std::move(*m.mutable_text()));
  out.set_index(m.index());
  if (m.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
    out.set_finish_reason(m.finish_reason());
    *out.mutable_usage() = m.usage();
    *out.mutable_timings() = m.timings();
    if (m.has_stop()) *out.mutable_stop() = m.stop();
    out.set_failovers(failovers_);
    out.set_resumes(resumes_);
    out.set_seed(request_.sampling().seed() + static_cast<uint64_t>(m.index()));  // sample i's
  }
  if (!forwarded_) out.set_request_id(request_.request_id());
  forwarded_ = true;
  f.first_tokens = sent_.empty() && out.token_ids_size() > 0;
  sent_.insert(sent_.end(), out.token_ids().begin(), out.token_ids().end());
  return f;
}

RelayAction Relay::Ended(const absl::Status& ended, bool stalled, absl::Time now) {
  absl::Status s = ended;
  if (stalled) s = absl::UnavailableError("a worker stopped sending (frozen or unreachable)");
  if (s.ok() || !RetriableOnAnotherWorker(s.code())) {
    RelayAction a;
    a.kind = RelayAction::Kind::kFinish;
    a.status = s;
    return a;
  }
  last_ = s;
  RelayAction a;  // kPick
  a.stalled = stalled;
  if (absl::IsResourceExhausted(s)) {
    full_.push_back(current_);
  } else {
    a.failed = current_;
    failed_.push_back(current_);
    if (++failed_calls_ >= rules_.max_attempts) {
      RelayAction f = Fail();
      f.failed = a.failed;
      f.stalled = stalled;
      return f;
    }
  }
  if (forwarded_ && !absl::IsResourceExhausted(s)) {  // the stream leaves its worker
    ++failovers_;
    a.failover = true;
    resume_deadline_ = std::min(resume_deadline_, now + rules_.resume_wait);
  }
  return a;
}

RelayAction Relay::ClientGone() {
  RelayAction a;
  a.kind = RelayAction::Kind::kFinish;
  a.status = absl::CancelledError("the client cancelled");
  return a;
}

RelayAction Relay::Fail() const {
  RelayAction a;
  a.kind = RelayAction::Kind::kFinish;
  if (absl::IsResourceExhausted(last_) && !forwarded_) {
    a.status = absl::ResourceExhaustedError("every worker is full; retry after a short wait");
    a.retry_pushback_ms = 200;
    return a;
  }
  a.status = absl::UnavailableError(absl::StrCat(
      "no worker could serve the request",
      sent_.empty() ? "" : absl::StrCat(" after ", sent_.size(), " tokens were sent"), " (", calls_,
      calls_ == 1 ? " worker call" : " worker calls", "; last error: ", last_.message(), ")"));
  return a;
}

}  // namespace infinigen
