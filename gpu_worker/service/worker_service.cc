#include "gpu_worker/service/worker_service.h"

#include <prometheus/histogram.h>

#include <deque>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/grpc/status.h"
#include "common/status_macros.h"
#include "frontend/prompt.h"

namespace infinigen {
namespace {

namespace wv1 = worker::v1;

infinigen::v1::FinishReason ToProto(FinishReason r) {
  switch (r) {
    case FinishReason::kLength:
      return infinigen::v1::FINISH_REASON_LENGTH;
    case FinishReason::kStop:
      return infinigen::v1::FINISH_REASON_STOP;
    case FinishReason::kCancelled:
      return infinigen::v1::FINISH_REASON_CANCELLED;
  }
  return infinigen::v1::FINISH_REASON_UNSPECIFIED;
}

// `token`'s logprobs, with each token's text where there is a tokenizer (the text a client
// shows for a logprob; the HTTP door need not ask the worker for it).
void ToProto(const TokenLogprobs& in, int32_t token, const Tokenizer* tokenizer,
             infinigen::v1::Logprobs& out) {
  auto text = [tokenizer](int32_t id) { return tokenizer->Decode(std::span(&id, 1)); };
  out.set_logprob(in.logprob);
  out.set_rank(static_cast<int32_t>(in.rank));
  if (tokenizer != nullptr) out.set_token(text(token));
  for (const auto& [id, value] : in.top) {
    infinigen::v1::TokenLogprob* t = out.add_top();
    t->set_token_id(id);
    t->set_logprob(value);
    if (tokenizer != nullptr) t->set_token(text(id));
  }
}

// The engine's events for one call (of each sample: index, event), handed from the engine
// thread to the call's thread.
struct CallEvents {
  absl::Mutex mu;
  std::deque<std::pair<int, EngineEvent>> events ABSL_GUARDED_BY(mu);
};

// One sample of the call's prompt (sampling.n): its engine request and its text.
struct Sample {
  uint64_t id = 0;
  std::vector<int32_t> resumed;  // the tokens it streamed from a failed worker
  std::optional<SampleText> text;
  bool done = false;
};

}  // namespace

WorkerService::WorkerService(BatchEngine& engine, const Model& model, const Tokenizer* tokenizer,
                             const InfinigenSidecar* sidecar, const WorkerServiceOptions& options)
    : engine_(engine),
      model_(model),
      tokenizer_(tokenizer),
      sidecar_(sidecar),
      options_(options),
      backend_name_(model.backend().Name()) {}

absl::StatusOr<std::string> WorkerService::RenderChat(const infinigen::v1::ChatMessages& m) const {
  IG_RETURN_IF_ERROR(ValidateChatMessages(m));
  std::vector<ChatMessage> messages;
  for (const auto& x : m.messages()) messages.push_back({x.role(), x.content()});
  return infinigen::RenderChat(*tokenizer_, messages);
}

absl::StatusOr<std::vector<int32_t>> WorkerService::PromptTokens(
    const wv1::GenerateRequest& r) const {
  std::vector<int32_t> ids;
  if (tokenizer_ == nullptr && (r.input_case() == wv1::GenerateRequest::kText ||
                                r.input_case() == wv1::GenerateRequest::kMessages)) {
    return absl::FailedPreconditionError(
        "this worker's model has no tokenizer files: send the prompt as token_ids");
  }
  switch (r.input_case()) {
    case wv1::GenerateRequest::kText: {
      IG_ASSIGN_OR_RETURN(ids, EncodeTextPrompt(*tokenizer_, r.text()));
      break;
    }
    case wv1::GenerateRequest::kTokenIds:
      ids.assign(r.token_ids().ids().begin(), r.token_ids().ids().end());
      if (ids.empty()) return absl::InvalidArgumentError("token_ids: the prompt is empty");
      break;
    case wv1::GenerateRequest::kMessages: {
      IG_ASSIGN_OR_RETURN(std::string text, RenderChat(r.messages()));
      ids = tokenizer_->Encode(text, /*add_special=*/false);  // the template holds BOS
      break;
    }
    default:
      return absl::InvalidArgumentError("input: give one of text, token_ids or messages");
  }
  IG_RETURN_IF_ERROR(
      CheckPromptLength(static_cast<int64_t>(ids.size()), options_.limits.max_prompt_tokens,
                        model_.config().max_position_embeddings, r.max_prompt_tokens()));
  return ids;
}

absl::StatusOr<GenerateOptions> WorkerService::Options(const wv1::GenerateRequest& r) const {
  IG_ASSIGN_OR_RETURN(GenerateOptions o,
                      RequestOptions(r.sampling(), r.stopping(), options_.limits));
  // What needs the model: ids inside its vocabulary, text to match stop strings against.
  for (int32_t id : o.stop_token_ids) {
    if (id >= model_.config().vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("stopping.stop_token_ids: ", id, " is outside the vocabulary"));
    }
  }
  if (o.json_object && tokenizer_ == nullptr) {
    return absl::FailedPreconditionError(
        "sampling.response_format: JSON_OBJECT needs the text of each token, and this worker's "
        "model has no tokenizer files");
  }
  if (r.stopping().stop_strings_size() > 0 && tokenizer_ == nullptr) {
    return absl::FailedPreconditionError(
        "stopping.stop_strings: this worker's model has no tokenizer files to match text against");
  }
  return o;
}

absl::StatusOr<std::unique_ptr<KvSelectionPolicy>> WorkerService::Policy(
    const wv1::GenerateRequest& r) const {
  SelectionOverrides o;
  if (!r.selection().policy().empty()) {
    auto kind = ParsePolicyKind(r.selection().policy());
    if (!kind.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("selection.policy: ", kind.status().message()));
    }
    o.policy = *kind;
  }
  if (r.selection().has_budget_fraction()) o.budget_fraction = r.selection().budget_fraction();
  if (r.selection().has_alpha()) o.alpha = r.selection().alpha();
  IG_ASSIGN_OR_RETURN(SelectionConfig config,
                      ApplyOverrides(options_.selection, o, options_.selection_limits));
  if (config.policy == PolicyKind::kFull) return std::unique_ptr<KvSelectionPolicy>();  // dense
  if (config.policy == PolicyKind::kInfinigen && sidecar_ == nullptr) {
    return absl::InvalidArgumentError(
        "selection.policy: infinigen needs a sidecar, and this worker was started without one");
  }
  return MakeSelectionPolicy(config, model_.config(), sidecar_, options_.skew_on_backend);
}

absl::StatusOr<std::unique_ptr<TokenConstraint>> WorkerService::JsonConstraint(
    std::span<const int32_t> resumed) {
  std::shared_ptr<const JsonVocabulary> vocabulary;
  {
    absl::MutexLock l(&json_mu_);
    if (json_vocabulary_ == nullptr) json_vocabulary_ = JsonVocabulary::FromTokenizer(*tokenizer_);
    vocabulary = json_vocabulary_;
  }
  auto mask = std::make_unique<JsonTokenMask>(std::move(vocabulary));
  for (size_t i = 0; i < resumed.size(); ++i) {
    if (!mask->Accept(resumed[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("resumed tokens: token ", resumed[i], " at ", i,
                       " does not continue a JSON object (sampling.response_format)"));
    }
  }
  return mask;
}

grpc::Status WorkerService::Generate(grpc::ServerContext* context,
                                     const wv1::GenerateRequest* request,
                                     grpc::ServerWriter<wv1::GenerateResponse>* writer) {
  if (draining_) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "this worker is draining; send the request to another worker");
  }
  // The options first: they check sampling.n, which sizes what follows.
  auto checked = Options(*request);
  if (!checked.ok()) return ToGrpcStatus(checked.status());
  const GenerateOptions options = std::move(*checked);
  const int n = std::max(1, request->sampling().n());  // in [1, kMaxSamples]
  if (n > 1 && (request->resume_token_ids_size() > 0 || request->resume_store_sequence_id() != 0 ||
                !request->session_id().empty())) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "sampling.n > 1 cannot be combined with a session_id or resume_token_ids "
                        "(a stream of several samples resumes with resumed_samples)");
  }
  // A stream of several samples continued after a failover: each sample's own resume.
  std::vector<const wv1::ResumedSample*> resumed(n, nullptr);
  if (n == 1 && request->resumed_samples_size() > 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "resumed_samples is for sampling.n > 1 (one stream: resume_token_ids)");
  }
  for (const wv1::ResumedSample& r : request->resumed_samples()) {
    if (r.index() < 0 || r.index() >= n || resumed[r.index()] != nullptr) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("resumed_samples: index ", r.index(),
                                       " is outside [0, sampling.n) or listed twice"));
    }
    resumed[r.index()] = &r;
  }
  std::vector<int32_t> prompt;
  std::unique_ptr<KvSelectionPolicy> first_policy;  // the first submitted sample's
  std::string policy_name;
  {
    auto p = PromptTokens(*request);
    if (!p.ok()) return ToGrpcStatus(p.status());
    prompt = std::move(*p);
    auto policy = Policy(*request);
    if (!policy.ok()) return ToGrpcStatus(policy.status());
    first_policy = std::move(*policy);
    policy_name =
        first_policy != nullptr ? first_policy->Name() : PolicyKindName(PolicyKind::kFull);
  }
  // What prompt_logprobs entries name (the engine's are by position).
  const std::vector<int32_t> prompt_ids =
      options.prompt_logprobs >= 0 ? prompt : std::vector<int32_t>();

  // Sample i draws with seed + i. A fresh request's first sample prefills and the others copy
  // its KV; resumed samples continue each from its own.
  auto events = std::make_shared<CallEvents>();
  std::vector<Sample> samples(n);
  auto cancel_all = [&] {
    for (const Sample& x : samples) {
      if (x.id != 0 && !x.done) engine_.Cancel(x.id);
    }
  };
  const bool share = n > 1 && request->resumed_samples_size() == 0;
  int running = 0;
  for (int i = 0; i < n; ++i) {
    Sample& x = samples[i];
    if (n == 1) {
      x.resumed.assign(request->resume_token_ids().begin(), request->resume_token_ids().end());
    } else if (resumed[i] != nullptr) {
      x.resumed.assign(resumed[i]->token_ids().begin(), resumed[i]->token_ids().end());
      if (resumed[i]->finished()) {  // it sent its last message before the failover
        x.done = true;
        continue;
      }
    }
    EngineRequest er;
    er.prompt = prompt;
    er.options = options;
    er.options.sampling.seed = request->sampling().seed() + static_cast<uint64_t>(i);
    if (i > 0) er.options.prompt_logprobs = -1;  // sent once, with sample 0
    if (running == 0) {
      er.policy = std::move(first_policy);
    } else {
      auto policy = Policy(*request);  // its own state; made once above, so it succeeds
      if (!policy.ok()) {
        cancel_all();
        return ToGrpcStatus(policy.status());
      }
      er.policy = std::move(*policy);
    }
    er.resume_tokens = x.resumed;
    if (options.json_object) {
      auto constraint = JsonConstraint(x.resumed);
      if (!constraint.ok()) {
        cancel_all();
        return ToGrpcStatus(constraint.status());
      }
      er.constraint = std::move(*constraint);
    }
    er.attach_home = n == 1                  ? request->resume_store_sequence_id()
                     : resumed[i] != nullptr ? resumed[i]->store_sequence_id()
                                             : 0;
    er.session_id = request->session_id();
    er.deadline = absl::FromChrono(context->deadline());
    if (share) er.prefill_from = samples[0].id;
    auto id = engine_.Submit(std::move(er), [events, i](const EngineEvent& e) {
      absl::MutexLock l(&events->mu);
      events->events.emplace_back(i, e);
    });
    if (!id.ok()) {
      cancel_all();  // the samples submitted end at the next step; their events go nowhere
      if (absl::IsResourceExhausted(id.status())) {
        // gRPC clients with a retry policy wait this long before trying again.
        context->AddTrailingMetadata("grpc-retry-pushback-ms", "200");
      }
      return ToGrpcStatus(id.status());
    }
    x.id = *id;
    ++running;
  }

  for (Sample& x : samples) {
    x.text.emplace(tokenizer_, request->skip_special_tokens(),
                   std::vector<std::string>(request->stopping().stop_strings().begin(),
                                            request->stopping().stop_strings().end()),
                   request->stopping().include_stop_str_in_output());
    // The text of resumed tokens was sent by the worker before, except what it still held
    // back: replaying them leaves this text where that worker's was.
    for (int32_t t : x.resumed) x.text->Add(t);
  }
  bool cancelled = false;
  absl::Status failed;  // the first sample that failed: the call fails with it
  while (running > 0) {
    std::deque<std::pair<int, EngineEvent>> batch;
    {
      absl::MutexLock l(&events->mu);
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(events->mu) {
        return !events->events.empty();
      };
      events->mu.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(50));
      batch.swap(events->events);
    }
    if (!cancelled && context->IsCancelled()) {
      cancel_all();  // frees the store sequences at the next step; wait for their ends
      cancelled = true;
    }
    // A sample's first message: where its KV lives, and the prompt's logprobs when asked.
    auto first_message = [&](int index, const EngineEvent& e) {
      wv1::GenerateResponse r;
      r.set_index(index);
      r.set_store_sequence_id(e.home);
      r.set_attached(e.attached);
      for (size_t j = 0; j < e.prompt_logprobs.size() && j + 1 < prompt_ids.size(); ++j) {
        infinigen::v1::Logprobs* lp = r.add_prompt_logprobs();
        ToProto(e.prompt_logprobs[j], prompt_ids[j + 1], tokenizer_, *lp);
        lp->set_token_id(prompt_ids[j + 1]);
      }
      return r;
    };
    for (const auto& [index, e] : batch) {
      Sample& x = samples[index];
      if (e.token < 0 && !e.done && !cancelled && failed.ok()) {  // a prompt-only request's
        if (!writer->Write(first_message(index, e))) {
          cancel_all();
          cancelled = true;
        }
      }
      if (e.token >= 0 && !cancelled && failed.ok() && !x.text->stopped()) {
        wv1::GenerateResponse r = first_message(index, e);
        r.add_token_ids(e.token);
        if (e.has_logprobs) ToProto(e.logprobs, e.token, tokenizer_, *r.add_logprobs());
        if (x.text->has_text()) r.set_text(x.text->Add(e.token));
        // A completed stop string ends the sample: the engine frees it at its next step.
        if (x.text->stopped()) engine_.Cancel(x.id);
        if (!writer->Write(r)) {
          cancel_all();
          cancelled = true;
        }
      }
      if (!e.done) continue;
      x.done = true;
      --running;
      if (!e.status.ok() && failed.ok()) {
        failed = e.status;
        cancel_all();
      }
      if (cancelled || !failed.ok()) continue;
      writer->Write(
          LastMessage(index, static_cast<int64_t>(x.resumed.size()), e, *x.text, policy_name));
    }
  }
  if (cancelled) return grpc::Status(grpc::StatusCode::CANCELLED, "the client cancelled");
  if (!failed.ok()) return ToGrpcStatus(failed);
  return grpc::Status::OK;
}

wv1::GenerateResponse WorkerService::LastMessage(int index, int64_t resumed, const EngineEvent& e,
                                                 SampleText& text, const std::string& policy_name) {
  const RequestUsage& u = e.usage;
  wv1::GenerateResponse last;
  last.set_index(index);
  if (text.has_text()) last.set_text(text.Finish());
  last.set_finish_reason(text.stopped() ? infinigen::v1::FINISH_REASON_STOP
                                        : ToProto(e.finish_reason));
  if (text.stopped()) {
    last.mutable_stop()->set_stop_string(text.matched_stop());
  } else if (e.finish_reason == FinishReason::kStop && e.stop_token >= 0) {
    last.mutable_stop()->set_token_id(e.stop_token);
  }
  auto* usage = last.mutable_usage();
  usage->set_prompt_tokens(static_cast<int32_t>(u.prompt_tokens));
  usage->set_generated_tokens(static_cast<int32_t>(u.generated_tokens));
  usage->set_kv_bytes_fetched(u.fetch.bytes_fetched);
  usage->set_kv_bytes_full_fetch(u.fetch.bytes_full);
  usage->set_selection_fraction(u.fetch.bytes_full > 0
                                    ? static_cast<double>(u.fetch.bytes_fetched) /
                                          static_cast<double>(u.fetch.bytes_full)
                                    : 1.0);
  usage->set_cached_tokens(u.cached_tokens);
  usage->set_policy(policy_name);
  usage->set_backend(backend_name_);
  auto* t = last.mutable_timings();
  t->set_queue_seconds(u.queue_seconds);
  t->set_time_to_first_token_seconds(u.time_to_first_token);
  const int64_t here = u.generated_tokens - resumed;
  const double tpot = here > 1 ? u.decode_seconds / static_cast<double>(here - 1) : 0.0;
  t->set_time_per_output_token_seconds(tpot);
  t->set_gather_wait_seconds(u.fetch.wait_seconds);
  if (latency_.time_to_first_token != nullptr && here > 0) {
    latency_.time_to_first_token->Observe(u.time_to_first_token);
  }
  if (latency_.time_per_output_token != nullptr && here > 1) {
    latency_.time_per_output_token->Observe(tpot);
  }
  return last;
}

grpc::Status WorkerService::Tokenize(grpc::ServerContext*, const infinigen::v1::TokenizeRequest* r,
                                     infinigen::v1::TokenizeResponse* out) {
  if (tokenizer_ == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "this worker's model has no tokenizer files");
  }
  std::vector<int32_t> ids;
  switch (r->input_case()) {
    case infinigen::v1::TokenizeRequest::kText:
      ids = tokenizer_->Encode(r->text(), r->add_special());
      break;
    case infinigen::v1::TokenizeRequest::kMessages: {
      auto text = RenderChat(r->messages());
      if (!text.ok()) return ToGrpcStatus(text.status());
      ids = tokenizer_->Encode(*text, /*add_special=*/false);
      out->set_text(*text);
      break;
    }
    case infinigen::v1::TokenizeRequest::kTokenIds:
      ids.assign(r->token_ids().ids().begin(), r->token_ids().ids().end());
      for (int32_t id : ids) {
        if (id < 0 || id >= tokenizer_->vocab_size()) {
          return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              absl::StrCat("token_ids: ", id, " is outside the vocabulary [0, ",
                                           tokenizer_->vocab_size(), ")"));
        }
      }
      out->set_text(tokenizer_->Decode(ids));
      break;
    default:
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "input: give one of text, messages or token_ids");
  }
  // Each token's text as it adds to the decoded text (not its vocabulary entry, e.g. "Ġworld"):
  // the pieces concatenate to Decode(ids); a token that ends inside a UTF-8 character adds
  // nothing and the one that completes it carries the character.
  IncrementalDecoder pieces(*tokenizer_, /*skip_special=*/false);
  for (int32_t id : ids) {
    out->add_token_ids(id);
    out->add_pieces(pieces.Add(id));
  }
  if (std::string tail = pieces.Finish(); !tail.empty() && out->pieces_size() > 0) {
    *out->mutable_pieces(out->pieces_size() - 1) += tail;
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::Info(grpc::ServerContext*, const wv1::InfoRequest*,
                                 wv1::InfoResponse* r) {
  const ModelConfig& c = model_.config();
  r->set_model(options_.model_name);
  r->set_architecture(c.architecture == Architecture::kLlama ? "llama" : "opt");
  r->set_num_layers(static_cast<int32_t>(c.num_layers));
  r->set_num_heads(static_cast<int32_t>(c.num_heads));
  r->set_num_kv_heads(static_cast<int32_t>(c.num_kv_heads));
  r->set_head_dim(static_cast<int32_t>(c.head_dim));
  r->set_vocab_size(static_cast<int32_t>(c.vocab_size));
  r->set_max_context_tokens(c.max_position_embeddings);
  r->set_max_new_tokens_limit(options_.limits.max_new_tokens_limit);
  r->set_max_running(options_.engine.max_running);
  r->set_max_queued(options_.engine.max_queued);
  const EngineStats s = engine_.Stats();
  r->set_running(static_cast<int32_t>(s.running));
  r->set_queued(static_cast<int32_t>(s.queued));
  r->set_kv_transport(options_.kv_transport);
  r->set_default_policy(PolicyKindName(options_.selection.policy));
  for (PolicyKind p : options_.selection_limits.allowed_policies)
    r->add_policies(PolicyKindName(p));
  r->set_draining(draining_);
  r->set_backend(backend_name_);
  return grpc::Status::OK;
}

}  // namespace infinigen
