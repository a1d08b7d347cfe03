// The OpenAI JSON a ResponseBuilder makes of GenerateResponses' logprobs: each token's text is the
// one the worker sent with it (Logprobs.token, TokenLogprob.token), and only an entry without one
// asks the TokenText callback (a worker without a tokenizer); completions' text_offset counts the
// texts' bytes, chat's `bytes` lists them.
#include "openai/openai_json.h"

#include <gtest/gtest.h>

#include <vector>

#include "nlohmann/json.hpp"

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

}  // namespace
}  // namespace infinigen::openai
