// The OpenAI-compatible API's JSON: requests parsed (openai/request_json.h: batches of prompts,
// response_format, echo, the fields refused by name), and what a ResponseBuilder makes of
// GenerateResponses' logprobs: each token's text is the one the worker sent with it
// (Logprobs.token, TokenLogprob.token), and only an entry without one asks the TokenText
// callback (a worker without a tokenizer); completions' text_offset counts the texts' bytes,
// chat's `bytes` lists them.
#include <gtest/gtest.h>

#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "openai/request_json.h"
#include "openai/response_json.h"

namespace infinigen::openai {
namespace {

using nlohmann::json;

// A response with one token, its text `text` (none: unset) and one alternative, id 7, text "alt"
// (unset when `text` is).
v1::GenerateResponse OneToken(int32_t id, const char* text) {
  v1::GenerateResponse r;
  r.add_token_ids(id);
  v1::Logprobs* lp = r.add_logprobs();
  lp->set_logprob(-0.5f);
  if (text != nullptr) lp->set_token(text);
  v1::TokenLogprob* t = lp->add_top();
  t->set_token_id(7);
  t->set_logprob(-0.25f);
  if (text != nullptr) t->set_token("alt");
  return r;
}

TEST(OpenAiJson, LogprobTextsAreTheWorkersAndOnlyMissingOnesAreLookedUp) {
  std::vector<int32_t> asked;
  auto lookup = [&asked](int32_t id) {
    asked.push_back(id);
    return "<" + std::to_string(id) + ">";
  };
  ResponseBuilder completions(Endpoint::kCompletions, "cmpl-1", 0, "m", 1, lookup);
  completions.Add(OneToken(3, " h\xc3\xa9"));
  completions.Add(OneToken(4, nullptr));
  v1::GenerateResponse last;
  last.set_finish_reason(v1::FINISH_REASON_LENGTH);
  completions.Add(last);
  const json whole = json::parse(completions.Whole());
  const json& lp = whole["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], json({" h\xc3\xa9", "<4>"}));
  EXPECT_EQ(lp["top_logprobs"][0], json({{"alt", -0.25}}));
  EXPECT_EQ(lp["top_logprobs"][1], json({{"<7>", -0.25}}));
  EXPECT_EQ(lp["text_offset"], json({0, 4}));  // " hé" is 4 bytes
  EXPECT_EQ(asked, (std::vector<int32_t>{4, 7}));

  asked.clear();
  ResponseBuilder chat(Endpoint::kChatCompletions, "chat-1", 0, "m", 1, lookup);
  const std::vector<std::string> chunks = chat.Chunks(OneToken(3, "\xc3"));  // half a character
  EXPECT_TRUE(asked.empty());
  bool found = false;
  for (const std::string& c : chunks) {
    const json j = json::parse(c);
    const json& logprobs = j["choices"][0]["logprobs"];
    if (!logprobs.is_object() || logprobs["content"].empty()) continue;
    const json& content = logprobs["content"];
    found = true;
    EXPECT_EQ(content[0]["bytes"], json({0xc3}));
    EXPECT_EQ(content[0]["top_logprobs"][0]["token"], "alt");
    EXPECT_EQ(content[0]["top_logprobs"][0]["bytes"], json({'a', 'l', 't'}));
  }
  EXPECT_TRUE(found) << chunks.size() << " chunks";
}

TEST(OpenAiJson, PromptLogprobsUseTheWorkersTexts) {
  std::vector<int32_t> asked;
  ResponseBuilder b(Endpoint::kCompletions, "cmpl-2", 0, "m", -1, [&asked](int32_t id) {
    asked.push_back(id);
    return std::string("?");
  });
  v1::GenerateResponse r;
  v1::Logprobs* lp = r.add_prompt_logprobs();
  lp->set_token_id(11);
  lp->set_logprob(-3.0f);
  lp->set_rank(2);
  lp->set_token(" world");
  v1::TokenLogprob* t = lp->add_top();
  t->set_token_id(12);
  t->set_logprob(-1.0f);
  t->set_token(" there");
  r.set_finish_reason(v1::FINISH_REASON_LENGTH);
  b.Add(r);
  const json got = json::parse(b.Whole())["choices"][0]["prompt_logprobs"];
  ASSERT_EQ(got.size(), 2u) << got.dump();
  EXPECT_EQ(got[1]["11"]["decoded_token"], " world");
  EXPECT_EQ(got[1]["12"]["decoded_token"], " there");
  EXPECT_TRUE(asked.empty());
}

TEST(OpenAiJson, EchoIsForCompletionsAndAsksForThePromptsLogprobs) {
  ParsedRequest parsed;
  ApiError error;
  ASSERT_TRUE(ParseRequest(
      Endpoint::kCompletions,
      R"({"prompt": "Hi there", "echo": true, "logprobs": 2, "max_tokens": 1})", parsed, error))
      << error.message;
  EXPECT_TRUE(parsed.echo);
  EXPECT_EQ(parsed.request.sampling().prompt_logprobs(), 2);
  EXPECT_EQ(parsed.prompt_logprobs, -1);  // not asked for by the client: not shown

  ParsedRequest plain;
  ASSERT_TRUE(
      ParseRequest(Endpoint::kCompletions, R"({"prompt": "Hi", "echo": true})", plain, error));
  EXPECT_FALSE(plain.request.sampling().has_prompt_logprobs());

  for (const auto& [endpoint, body, param] :
       std::vector<std::tuple<Endpoint, const char*, const char*>>{
           {Endpoint::kChatCompletions,
            R"({"messages": [{"role": "user", "content": "hi"}], "echo": true})", "echo"},
           {Endpoint::kCompletions, R"({"prompt": "Hi", "echo": true, "logprobs": 1, "n": 2})",
            "echo"},
           {Endpoint::kCompletions,
            R"({"prompt": "Hi", "echo": true, "logprobs": 1, "prompt_logprobs": 3})",
            "prompt_logprobs"},
           {Endpoint::kCompletions, R"({"prompt": "Hi", "echo": "yes"})", "echo"}}) {
    ParsedRequest bad;
    ApiError e;
    EXPECT_FALSE(ParseRequest(endpoint, body, bad, e)) << body;
    EXPECT_EQ(e.http_status, 400) << body;
    EXPECT_EQ(e.param, param) << body << ": " << e.message;
  }
}

// The sampling fields that map straight onto the gRPC request, and those refused with the
// field named.
TEST(OpenAiJson, SamplingFieldsMapOntoTheRequestOrAreRefusedByName) {
  ParsedRequest chat;
  ApiError error;
  ASSERT_TRUE(ParseRequest(Endpoint::kChatCompletions,
                           R"({"messages": [{"role": "user", "content": "hi"}],
                               "max_completion_tokens": 7, "top_p": 0.5, "user": "u-1",
                               "logit_bias": {"42": -100, "7": 2.5}, "frequency_penalty": 0.5,
                               "presence_penalty": -2})",
                           chat, error))
      << error.message;
  EXPECT_EQ(chat.request.stopping().max_new_tokens(), 7);
  EXPECT_EQ(chat.request.user(), "u-1");  // for the router's log line
  EXPECT_FLOAT_EQ(chat.request.sampling().top_p(), 0.5f);
  EXPECT_EQ(chat.request.sampling().logit_bias().size(), 2u);
  EXPECT_FLOAT_EQ(chat.request.sampling().logit_bias().at(42), -100.0f);
  EXPECT_FLOAT_EQ(chat.request.sampling().logit_bias().at(7), 2.5f);
  EXPECT_FLOAT_EQ(chat.request.sampling().frequency_penalty(), 0.5f);
  EXPECT_FLOAT_EQ(chat.request.sampling().presence_penalty(), -2.0f);
  for (const auto& [body, param] : std::vector<std::pair<const char*, const char*>>{
           {R"({"prompt": "Hi", "frequency_penalty": 2.5})", "frequency_penalty"},
           {R"({"prompt": "Hi", "presence_penalty": -3})", "presence_penalty"},
           {R"({"prompt": "Hi", "presence_penalty": "1"})", "presence_penalty"},
           {R"({"prompt": "Hi", "user": 5})", "user"},
           {R"({"prompt": "Hi", "top_p": 1.5})", "top_p"},
           {R"({"prompt": "Hi", "logit_bias": {"x": 1}})", "logit_bias"},
           {R"({"prompt": "Hi", "logit_bias": [1]})", "logit_bias"}}) {
    ParsedRequest bad;
    ApiError e;
    EXPECT_FALSE(ParseRequest(Endpoint::kCompletions, body, bad, e)) << body;
    EXPECT_EQ(e.http_status, 400) << body;
    EXPECT_EQ(e.param, param) << body << ": " << e.message;
  }
  ParsedRequest zero;
  ApiError e;
  EXPECT_FALSE(ParseRequest(Endpoint::kChatCompletions,
                            R"({"messages": [{"role": "user", "content": "hi"}],
                                "max_completion_tokens": 0})",
                            zero, e));
  EXPECT_EQ(e.param, "max_completion_tokens") << e.message;
}

// Content parts (and a response_format) of other JSON types than a client would send get a 400
// naming the field, not an exception (the fuzzer found a part with "type": 9 ending the process:
// json::value() throws for a field of another type).
TEST(OpenAiJson, ContentPartsOfTheWrongTypesAreRefused) {
  ParsedRequest parts;
  ApiError error;
  ASSERT_TRUE(ParseRequest(Endpoint::kChatCompletions,
                           R"({"messages": [{"role": "developer", "content": [
                                 {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                               {"role": "user", "content": "y"}]})",
                           parts, error))
      << error.message;
  EXPECT_EQ(parts.request.messages().messages(0).content(), "ab");
  EXPECT_EQ(parts.request.messages().messages(0).role(), "system");
  for (const char* content : {R"([{"type": 9, "text": "x"}])", R"([{"type": null, "text": "x"}])",
                              R"([{"type": ["text"], "text": "x"}])", R"([{"text": "x"}])",
                              R"([{"type": "text", "text": 3}])", R"([{"type": "image_url"}])",
                              R"([7])", R"({"type": "text"})"}) {
    const std::string body =
        absl::StrCat(R"({"messages": [{"role": "user", "content": )", content, "}]}");
    ParsedRequest bad;
    ApiError e;
    EXPECT_FALSE(ParseRequest(Endpoint::kChatCompletions, body, bad, e)) << body;
    EXPECT_EQ(e.http_status, 400) << body;
    EXPECT_EQ(e.param, "messages[0].content") << body << ": " << e.message;
  }
  for (const char* format : {R"({"type": 5})", R"({"type": "json_schema"})", R"("text")"}) {
    const std::string body = absl::StrCat(
        R"({"messages": [{"role": "user", "content": "y"}], "response_format": )", format, "}");
    ParsedRequest bad;
    ApiError e;
    EXPECT_FALSE(ParseRequest(Endpoint::kChatCompletions, body, bad, e)) << body;
    EXPECT_EQ(e.param, "response_format") << body << ": " << e.message;
  }
  ParsedRequest json_mode;
  ASSERT_TRUE(ParseRequest(
      Endpoint::kChatCompletions,
      R"({"messages": [{"role": "user", "content": "y"}], "response_format": {"type": "json_object"}})",
      json_mode, error))
      << error.message;
  EXPECT_EQ(json_mode.request.sampling().response_format(), v1::RESPONSE_FORMAT_JSON_OBJECT);
}

// The first message of an echoed completion: one generated token (id 9, " x") after a prompt of
// three tokens (" a", " bc", " d": the first has no logprob).
v1::GenerateResponse EchoedFirstMessage() {
  v1::GenerateResponse r = OneToken(9, " x");
  const std::vector<std::pair<int32_t, const char*>> prompt = {{5, " bc"}, {6, " d"}};
  for (const auto& [id, text] : prompt) {
    v1::Logprobs* lp = r.add_prompt_logprobs();
    lp->set_token_id(id);
    lp->set_token(text);
    lp->set_logprob(-1.5f);
    v1::TokenLogprob* t = lp->add_top();
    t->set_token_id(id);
    t->set_token(text);
    t->set_logprob(-1.5f);
  }
  return r;
}

TEST(OpenAiJson, EchoPutsThePromptBeforeTheCompletionWholeAndStreamed) {
  auto lookup = [](int32_t id) { return "<" + std::to_string(id) + ">"; };
  ResponseBuilder whole(Endpoint::kCompletions, "cmpl-3", 0, "m", 1, lookup);
  whole.Echo(" a bc d", {" a", " bc", " d"}, /*show_prompt_logprobs=*/false);
  whole.Add(EchoedFirstMessage());
  v1::GenerateResponse more = OneToken(10, " y");
  more.set_text(" y");
  more.set_finish_reason(v1::FINISH_REASON_LENGTH);
  whole.Add(more);
  const json w = json::parse(whole.Whole());
  const json& choice = w["choices"][0];
  EXPECT_EQ(choice["text"], " a bc d y");  // the prompt's text, then the completion's
  EXPECT_FALSE(choice.contains("prompt_logprobs"));
  const json& lp = choice["logprobs"];
  EXPECT_EQ(lp["tokens"], json({" a", " bc", " d", " x", " y"}));
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  EXPECT_EQ(lp["token_logprobs"][1], -1.5);
  EXPECT_EQ(lp["top_logprobs"][2], json({{" d", -1.5}}));
  EXPECT_EQ(lp["token_logprobs"][3], -0.5);
  EXPECT_EQ(lp["text_offset"], json({0, 2, 5, 7, 9}));

  ResponseBuilder streamed(Endpoint::kCompletions, "cmpl-4", 0, "m", 1, lookup);
  streamed.Echo(" a bc d", {" a", " bc", " d"}, /*show_prompt_logprobs=*/true);
  const std::vector<std::string> first = streamed.Chunks(EchoedFirstMessage());
  ASSERT_EQ(first.size(), 1u);
  const json c = json::parse(first[0])["choices"][0];
  EXPECT_EQ(c["text"], " a bc d");  // OneToken's message has no text of its own
  EXPECT_EQ(c["logprobs"]["tokens"].size(), 4u);
  EXPECT_TRUE(c.contains("prompt_logprobs"));  // the client asked for them too
  const std::vector<std::string> second = streamed.Chunks(more);
  const json c2 = json::parse(second[0])["choices"][0];
  EXPECT_EQ(c2["text"], " y");  // the prompt only once
  EXPECT_EQ(c2["logprobs"]["tokens"], json({" y"}));
}

TEST(OpenAiJson, EchoedOffsetsEndAtThePromptsEndAfterABos) {
  // The model added a BOS ("<s>") the prompt string has not: the pieces join to "<s> a bc d",
  // the offsets index " a bc d" (the BOS's clamped to 0), the completion's start at its end.
  ResponseBuilder b(Endpoint::kCompletions, "cmpl-5", 0, "m", 1,
                    [](int32_t id) { return std::to_string(id); });
  v1::GenerateResponse first = EchoedFirstMessage();
  v1::Logprobs* a = first.mutable_prompt_logprobs()->Add();
  first.mutable_prompt_logprobs()->SwapElements(0, 2);  // " a" first, then " bc", " d"
  first.mutable_prompt_logprobs()->SwapElements(1, 2);
  a->set_token_id(4);
  a->set_token(" a");
  a->set_logprob(-2.0f);
  b.Echo(" a bc d", {"<s>", " a", " bc", " d"}, false);
  first.set_finish_reason(v1::FINISH_REASON_LENGTH);
  b.Add(first);
  const json lp = json::parse(b.Whole())["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], json({"<s>", " a", " bc", " d", " x"}));
  EXPECT_EQ(lp["text_offset"], json({0, 0, 2, 5, 7}));
}

TEST(OpenAiJson, MaxTokensZeroWithEchoAsksForThePromptOnly) {
  ParsedRequest parsed;
  ApiError error;
  ASSERT_TRUE(ParseRequest(Endpoint::kCompletions,
                           R"({"prompt": "Hi", "echo": true, "logprobs": 1, "max_tokens": 0})",
                           parsed, error))
      << error.message;
  EXPECT_TRUE(parsed.prompt_only);
  EXPECT_EQ(parsed.request.stopping().max_new_tokens(), 0);  // the gRPC API's prompt-only
  {
    ParsedRequest several;
    ApiError e;
    EXPECT_FALSE(ParseRequest(Endpoint::kCompletions,
                              R"({"prompt": "Hi", "echo": true, "max_tokens": 0, "n": 2})", several,
                              e));
    EXPECT_EQ(e.param, "n") << e.message;
  }
  EXPECT_EQ(parsed.request.sampling().prompt_logprobs(), 1);
  ParsedRequest one;
  ASSERT_TRUE(
      ParseRequest(Endpoint::kCompletions, R"({"prompt": "Hi", "max_tokens": 1})", one, error));
  EXPECT_FALSE(one.prompt_only);
  for (const auto& [endpoint, body] : std::vector<std::pair<Endpoint, const char*>>{
           {Endpoint::kCompletions, R"({"prompt": "Hi", "max_tokens": 0})"},
           {Endpoint::kCompletions, R"({"prompt": "Hi", "max_tokens": -1, "echo": true})"},
           {Endpoint::kChatCompletions,
            R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})"}}) {
    ParsedRequest bad;
    ApiError e;
    EXPECT_FALSE(ParseRequest(endpoint, body, bad, e)) << body;
    EXPECT_EQ(e.http_status, 400) << body;
    EXPECT_EQ(e.param, "max_tokens") << body << ": " << e.message;
  }

  ParsedRequest bad;
  ApiError e;
  EXPECT_FALSE(ParseRequest(Endpoint::kCompletions,
                            R"({"prompt": "Hi", "echo": true, "max_tokens": 0, "min_tokens": 2})",
                            bad, e));
  EXPECT_EQ(e.param, "min_tokens") << e.message;

  // The one sampled token (" x", and it was EOS: STOP) is left out of text, entries and usage.
  v1::GenerateResponse first = EchoedFirstMessage();
  first.set_text(" x");
  first.set_finish_reason(v1::FINISH_REASON_STOP);
  first.mutable_usage()->set_prompt_tokens(3);
  first.mutable_usage()->set_generated_tokens(1);
  auto lookup = [](int32_t id) { return "<" + std::to_string(id) + ">"; };
  ResponseBuilder whole(Endpoint::kCompletions, "cmpl-6", 0, "m", 1, lookup);
  whole.Echo(" a bc d", {" a", " bc", " d"}, false, /*prompt_only=*/true);
  whole.Add(first);
  const json w = json::parse(whole.Whole());
  EXPECT_EQ(w["choices"][0]["text"], " a bc d");
  EXPECT_EQ(w["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(w["choices"][0]["logprobs"]["tokens"], json({" a", " bc", " d"}));
  EXPECT_EQ(w["usage"]["completion_tokens"], 0);
  EXPECT_EQ(w["usage"]["total_tokens"], 3);

  ResponseBuilder streamed(Endpoint::kCompletions, "cmpl-7", 0, "m", 1, lookup);
  streamed.Echo(" a bc d", {" a", " bc", " d"}, false, /*prompt_only=*/true);
  const std::vector<std::string> chunks = streamed.Chunks(first);
  ASSERT_EQ(chunks.size(), 1u);
  const json c = json::parse(chunks[0])["choices"][0];
  EXPECT_EQ(c["text"], " a bc d");
  EXPECT_EQ(c["finish_reason"], "length");
  EXPECT_EQ(c["logprobs"]["tokens"], json({" a", " bc", " d"}));
  EXPECT_EQ(json::parse(streamed.UsageChunk())["usage"]["completion_tokens"], 0);
}

TEST(OpenAiJson, TheMoreLikelyOfTwoAlternativesWithOneTextIsKept) {
  ResponseBuilder b(Endpoint::kCompletions, "cmpl-6", 0, "m", 2,
                    [](int32_t) { return std::string("?"); });
  v1::GenerateResponse r = OneToken(3, "the");
  v1::TokenLogprob* worse = r.mutable_logprobs(0)->add_top();
  worse->set_token_id(8);
  worse->set_token("alt");  // "▁alt" and "alt" decode alike
  worse->set_logprob(-4.0f);
  r.set_finish_reason(v1::FINISH_REASON_LENGTH);
  b.Add(r);
  const json top = json::parse(b.Whole())["choices"][0]["logprobs"]["top_logprobs"][0];
  EXPECT_EQ(top, json({{"alt", -0.25}}));
}

}  // namespace
}  // namespace infinigen::openai

namespace infinigen::openai {
namespace {

// /tokenize's answer with a piece that is half of a multi-byte character (a byte-level token):
// U+FFFD in its token_strs, never an exception; without return_token_strs, null.
TEST(OpenAiJson, TokenizeAnswersSurviveHalfCharacters) {
  v1::TokenizeResponse r;
  r.add_token_ids(7);
  r.add_token_ids(8);
  r.add_pieces("\xe2\x82");
  r.add_pieces("\xac");
  const nlohmann::json with = nlohmann::json::parse(TokenizeJson(r, 4096, true));
  EXPECT_EQ(with["count"], 2);
  EXPECT_EQ(with["max_model_len"], 4096);
  EXPECT_EQ(with["tokens"], nlohmann::json({7, 8}));
  ASSERT_EQ(with["token_strs"].size(), 2u);
  EXPECT_EQ(with["token_strs"][0], "\xef\xbf\xbd");  // the broken sequence: U+FFFD
  EXPECT_TRUE(nlohmann::json::parse(TokenizeJson(r, 4096, false))["token_strs"].is_null());
  TokenizeCall call;
  ApiError e;
  EXPECT_TRUE(ParseTokenizeRequest(R"({"tokens": [], "model": "m"})", true, call, e));
  EXPECT_EQ(call.model, "m");
  EXPECT_TRUE(call.request.has_token_ids());
  EXPECT_FALSE(ParseTokenizeRequest(R"([1, 2])", true, call, e));
  EXPECT_FALSE(ParseTokenizeRequest(R"({"messages": [{"role": "user", "content": "x"}],
                                        "add_special_tokens": true})",
                                    false, call, e));
  EXPECT_EQ(e.param, "add_special_tokens");
  // vLLM's fields that would change the count are refused, never ignored.
  for (const char* field : {R"("continue_final_message": true)", R"("chat_template": "{{x}}")",
                            R"("tools": [{"type": "function"}])"}) {
    ApiError refused;
    EXPECT_FALSE(ParseTokenizeRequest(
        absl::StrCat(R"({"messages": [{"role": "user", "content": "x"}], )", field, "}"), false,
        call, refused))
        << field;
    EXPECT_NE(std::string(field).find(refused.param), std::string::npos) << refused.param;
  }
}

// OpenAI's batch of prompts: a list of strings or of token-id lists, each its own request with the
// shared fields; a single list of ids stays one prompt; the limits name their field.
TEST(OpenAiJson, APromptListIsABatchOfRequestsWithTheSameFields) {
  ParsedRequest texts;
  ApiError error;
  ASSERT_TRUE(ParseRequest(Endpoint::kCompletions,
                           R"({"prompt": ["a", [5, 6], "c"], "max_tokens": 3, "n": 2, "seed": 9})",
                           texts, error))
      << error.message;
  ASSERT_EQ(texts.prompts(), 3);
  EXPECT_EQ(texts.Request(0).text(), "a");
  EXPECT_EQ(texts.Request(1).token_ids().ids_size(), 2);
  EXPECT_FALSE(texts.Request(1).has_text());
  EXPECT_EQ(texts.Request(2).text(), "c");
  for (int p = 0; p < 3; ++p) {
    EXPECT_EQ(texts.Request(p).stopping().max_new_tokens(), 3) << p;
    EXPECT_EQ(texts.Request(p).sampling().seed(), 9u) << p;
  }
  EXPECT_EQ(texts.n, 2);
  for (const char* one : {R"({"prompt": [5, 6]})", R"({"prompt": [[5, 6]]})", R"({"prompt": "a"})",
                          R"({"prompt": ["a"]})"}) {
    ParsedRequest parsed;
    ASSERT_TRUE(ParseRequest(Endpoint::kCompletions, one, parsed, error)) << one;
    EXPECT_EQ(parsed.prompts(), 1) << one;
    EXPECT_TRUE(parsed.batch.empty()) << one;
  }
  const std::string many = json{{"prompt", std::vector<std::string>(kMaxPrompts + 1, "x")}}.dump();
  const std::string wide =
      json{{"prompt", std::vector<std::string>(kMaxChoices / 16 + 1, "x")}, {"n", 16}}.dump();
  for (const auto& [body, param] :
       std::vector<std::pair<std::string, std::string>>{{R"({"prompt": ["a", []]})", "prompt"},
                                                        {R"({"prompt": ["a", 5]})", "prompt"},
                                                        {R"({"prompt": ["a", [-1]]})", "prompt"},
                                                        {R"({"prompt": []})", "prompt"},
                                                        {many, "prompt"},
                                                        {wide, "n"}}) {
    ParsedRequest parsed;
    ApiError e;
    EXPECT_FALSE(ParseRequest(Endpoint::kCompletions, body, parsed, e)) << body.substr(0, 60);
    EXPECT_EQ(e.param, param) << body.substr(0, 60);
    EXPECT_EQ(e.http_status, 400);
  }
  ParsedRequest at_limit;
  EXPECT_TRUE(ParseRequest(
      Endpoint::kCompletions,
      json{{"prompt", std::vector<std::string>(kMaxChoices / 16, "x")}, {"n", 16}}.dump(), at_limit,
      error))
      << error.message;
}

// The choices of a batch are prompt x n + i; usage counts each prompt's tokens once (its n
// choices share them) and every choice's generated tokens; echo prefixes each prompt's own text.
TEST(OpenAiJson, ABatchsChoicesUsageAndEchoAreEachPromptsOwn) {
  ResponseBuilder b(
      Endpoint::kCompletions, "cmpl-b", 0, "m", -1, [](int32_t) { return std::string("?"); },
      /*n=*/2, /*prompts=*/2);
  b.Echo("first", {}, false, false, 0);
  b.Echo("second", {}, false, false, 1);
  for (int c = 0; c < 4; ++c) {
    v1::GenerateResponse r;
    r.set_text(absl::StrCat(" t", c));
    r.set_finish_reason(v1::FINISH_REASON_LENGTH);
    r.mutable_usage()->set_prompt_tokens(c < 2 ? 5 : 7);
    r.mutable_usage()->set_cached_tokens(c < 2 ? 1 : 2);
    r.mutable_usage()->set_generated_tokens(c + 1);
    b.Add(c, r);
  }
  const json whole = json::parse(b.Whole());
  ASSERT_EQ(whole["choices"].size(), 4u);
  EXPECT_EQ(whole["choices"][0]["text"], "first t0");
  EXPECT_EQ(whole["choices"][1]["text"], "first t1");
  EXPECT_EQ(whole["choices"][2]["text"], "second t2");
  EXPECT_EQ(whole["choices"][3]["text"], "second t3");
  EXPECT_EQ(whole["choices"][3]["index"], 3);
  EXPECT_EQ(whole["usage"]["prompt_tokens"], 12);
  EXPECT_EQ(whole["usage"]["completion_tokens"], 10);
  EXPECT_EQ(whole["usage"]["total_tokens"], 22);
  EXPECT_EQ(whole["usage"]["prompt_tokens_details"]["cached_tokens"], 3);
}

}  // namespace
}  // namespace infinigen::openai
