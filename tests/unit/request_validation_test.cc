// The request front end's checks (frontend/request_validation.h), which the router and the
// worker both call: the limits struct, a request's sampling and stopping as the options the
// engine runs (defaults, every range), a public request as a whole, and the model's limits that
// the engine and the generator both ask (GenerateOptions::ValidateForModel).
#include "frontend/request_validation.h"

#include <gtest/gtest.h>

#include <vector>

#include "frontend/generate_options.h"

namespace infinigen {
namespace {

// INVALID_ARGUMENT whose message contains `field`.
void ExpectRefused(const absl::Status& st, const std::string& field) {
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find(field), std::string::npos) << st;
}

TEST(RequestLimits, EachLimitIsCheckedAndNamed) {
  EXPECT_TRUE(RequestLimits().Validate().ok());
  EXPECT_TRUE(WorkerRequestLimits().Validate().ok());
  EXPECT_EQ(RequestLimits().DefaultMaxNewTokens(), 256);
  RequestLimits l;
  l.max_request_bytes = 100;
  ExpectRefused(l.Validate(), "max_request_bytes");
  l = {};
  l.max_prompt_tokens = -1;
  ExpectRefused(l.Validate(), "max_prompt_tokens");
  l = {};
  l.max_new_tokens_limit = 0;
  ExpectRefused(l.Validate(), "max_new_tokens_limit");
  l = {};
  l.max_new_tokens_limit = 100;  // below the default's 256
  EXPECT_TRUE(l.Validate().ok());
  EXPECT_EQ(l.DefaultMaxNewTokens(), 100);
  l.default_max_new_tokens = 101;
  ExpectRefused(l.Validate(), "default_max_new_tokens");
}

TEST(GenerateOptions, TheModelsLimitsAreCheckedAndNamed) {
  GenerateOptions o;
  o.max_new_tokens = 6;
  const std::vector<int32_t> prompt = {0, 5, 9};
  EXPECT_TRUE(o.ValidateForModel(prompt, /*vocab_size=*/10, /*context_tokens=*/9).ok());
  ExpectRefused(o.ValidateForModel({}, 10, 9), "the prompt has no tokens");
  ExpectRefused(o.ValidateForModel(prompt, 9, 9), "token id 9 is outside the model's vocabulary");
  const std::vector<int32_t> negative = {3, -1};
  ExpectRefused(o.ValidateForModel(negative, 10, 9), "token id -1");
  // 3 prompt + 6 new tokens fill a context of 9 exactly; of 8 they do not.
  ExpectRefused(o.ValidateForModel(prompt, 10, 8), "exceeds the model's context of 8 tokens");
  o.logit_bias = {{10, 1.0f}};
  ExpectRefused(o.ValidateForModel(prompt, 10, 9), "sampling.logit_bias: token id 10");
  EXPECT_TRUE(CheckTokenIds(prompt, 10).ok());
  ExpectRefused(CheckTokenIds(prompt, 5), "token id 5");
}

TEST(RequestOptions, UnsetFieldsTakeTheServersDefaults) {
  RequestLimits limits;
  limits.default_max_new_tokens = 77;
  auto o = RequestOptions(v1::SamplingParams(), v1::StoppingCriteria(), limits);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->sampling.temperature, 1.0f);
  EXPECT_EQ(o->sampling.top_p, 1.0f);
  EXPECT_EQ(o->sampling.repetition_penalty, 1.0f);
  EXPECT_EQ(o->sampling.presence_penalty, 0.0f);
  EXPECT_EQ(o->sampling.frequency_penalty, 0.0f);
  EXPECT_EQ(o->max_new_tokens, 77);
  EXPECT_EQ(o->logprobs, -1);
  EXPECT_EQ(o->prompt_logprobs, -1);
  EXPECT_FALSE(o->json_object);

  v1::SamplingParams s;
  s.set_response_format(v1::RESPONSE_FORMAT_JSON_OBJECT);
  s.set_temperature(0.0f);
  s.set_seed(9);
  s.set_logprobs(3);
  (*s.mutable_logit_bias())[7] = -5.0f;
  (*s.mutable_logit_bias())[2] = 1.5f;
  v1::StoppingCriteria stop;
  stop.set_max_new_tokens(12);
  stop.set_min_tokens(4);
  stop.add_stop_token_ids(5);
  o = RequestOptions(s, stop, limits);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->sampling.greedy());
  EXPECT_EQ(o->sampling.seed, 9u);
  EXPECT_EQ(o->logprobs, 3);
  EXPECT_EQ(o->max_new_tokens, 12);
  EXPECT_EQ(o->min_tokens, 4);
  EXPECT_EQ(o->stop_token_ids, std::vector<int32_t>{5});
  const std::vector<std::pair<int32_t, float>> bias = {{2, 1.5f}, {7, -5.0f}};  // by id
  EXPECT_EQ(o->logit_bias, bias);
  EXPECT_TRUE(o->json_object);
}

TEST(RequestOptions, EveryRangeIsCheckedAndNamed) {
  RequestLimits limits;
  limits.max_new_tokens_limit = 100;
  ASSERT_TRUE(limits.Validate().ok());
  auto refused = [&](auto edit, const std::string& field) {
    v1::SamplingParams s;
    v1::StoppingCriteria stop;
    edit(s, stop);
    ExpectRefused(RequestOptions(s, stop, limits).status(), field);
  };
  using S = v1::SamplingParams;
  using T = v1::StoppingCriteria;
  refused([](S& s, T&) { s.set_temperature(-1.0f); }, "temperature");
  refused([](S& s, T&) { s.set_top_p(0.0f); }, "top_p");
  refused([](S& s, T&) { s.set_top_k(-2); }, "top_k");
  refused([](S& s, T&) { s.set_min_p(1.5f); }, "min_p");
  refused([](S& s, T&) { s.set_repetition_penalty(0.0f); }, "repetition_penalty");
  refused([](S& s, T&) { s.set_presence_penalty(2.01f); }, "presence_penalty");
  refused([](S& s, T&) { s.set_frequency_penalty(-2.5f); }, "frequency_penalty");
  refused([](S& s, T&) { s.set_frequency_penalty(NAN); }, "frequency_penalty");
  refused([](S& s, T&) { s.set_logprobs(kMaxLogprobs + 1); }, "sampling.logprobs");
  refused([](S& s, T&) { s.set_prompt_logprobs(-3); }, "sampling.prompt_logprobs");
  refused([](S& s, T&) { s.set_n(kMaxSamples + 1); }, "sampling.n");
  refused([](S& s, T&) { s.set_n(-1); }, "sampling.n");
  refused([](S& s, T&) { s.set_response_format(static_cast<v1::ResponseFormat>(7)); },
          "sampling.response_format");
  refused([](S& s, T&) { (*s.mutable_logit_bias())[3] = 101.0f; }, "sampling.logit_bias");
  refused([](S& s, T&) { (*s.mutable_logit_bias())[-3] = 1.0f; }, "sampling.logit_bias");
  refused(
      [](S& s, T&) {
        for (int i = 0; i <= kMaxLogitBias; ++i) (*s.mutable_logit_bias())[i] = 1.0f;
      },
      "sampling.logit_bias");
  refused([](S&, T& t) { t.set_max_new_tokens(-1); }, "max_new_tokens");
  refused(
      [](S& s, T& t) {  // the prompt only has no samples
        t.set_max_new_tokens(0);
        s.set_n(2);
      },
      "sampling.n");
  {  // 0: the prompt only
    v1::StoppingCriteria stop;
    stop.set_max_new_tokens(0);
    auto o = RequestOptions(v1::SamplingParams(), stop, limits);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->max_new_tokens, 0);
  }
  refused([](S&, T& t) { t.set_max_new_tokens(101); }, "max_new_tokens_limit");
  refused([](S&, T& t) { t.set_min_tokens(300); }, "stopping.min_tokens");
  refused([](S&, T& t) { t.add_stop_token_ids(-1); }, "stopping.stop_token_ids");
  refused([](S&, T& t) { t.add_stop_strings(""); }, "stopping.stop_strings");
  refused(
      [](S&, T& t) {
        for (int i = 0; i < 9; ++i) t.add_stop_strings("x");
      },
      "stopping.stop_strings");
  refused([](S&, T& t) { t.add_stop_strings(std::string(257, 'x')); }, "stopping.stop_strings");
}

TEST(ValidateGenerateRequest, APublicRequestIsCheckedWhole) {
  RequestLimits limits;
  limits.max_prompt_tokens = 4;
  v1::GenerateRequest r;
  ExpectRefused(ValidateGenerateRequest(r, limits), "input");
  r.set_text("");
  ExpectRefused(ValidateGenerateRequest(r, limits), "text");
  r.set_text("hello");
  EXPECT_TRUE(ValidateGenerateRequest(r, limits).ok());
  for (int i = 0; i < 5; ++i) r.mutable_token_ids()->add_ids(i);
  ExpectRefused(ValidateGenerateRequest(r, limits), "max_prompt_tokens");
  limits.max_prompt_tokens = 0;  // none but the workers' context
  EXPECT_TRUE(ValidateGenerateRequest(r, limits).ok());
  auto* m = r.mutable_messages()->add_messages();
  m->set_role("robot");
  ExpectRefused(ValidateGenerateRequest(r, limits), "system, user and assistant");
  m->set_role("user");
  EXPECT_TRUE(ValidateGenerateRequest(r, limits).ok());
  // The sampling and stopping checks are RequestOptions', before the request is queued.
  r.mutable_sampling()->set_logprobs(21);
  ExpectRefused(ValidateGenerateRequest(r, limits), "sampling.logprobs");
  r.mutable_sampling()->clear_logprobs();
  r.mutable_sampling()->set_n(2);
  EXPECT_TRUE(ValidateGenerateRequest(r, limits).ok());
  r.set_session_id("conversation-1");
  ExpectRefused(ValidateGenerateRequest(r, limits), "sampling.n");
  r.mutable_sampling()->set_n(1);
  EXPECT_TRUE(ValidateGenerateRequest(r, limits).ok());
  r.set_request_id(std::string(kMaxRequestIdBytes + 1, 'r'));
  ExpectRefused(ValidateGenerateRequest(r, limits), "request_id");
  r.set_request_id("r");
  r.set_user(std::string(kMaxRequestIdBytes + 1, 'u'));
  ExpectRefused(ValidateGenerateRequest(r, limits), "user");
  r.set_user("u");
  EXPECT_TRUE(ValidateGenerateRequest(r, limits).ok());
  limits.max_request_bytes = 1024;
  r.set_text(std::string(2000, 'a'));
  ExpectRefused(ValidateGenerateRequest(r, limits), "max_request_bytes");
}

}  // namespace
}  // namespace infinigen
