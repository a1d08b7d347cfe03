// The request front end's text (frontend/prompt.h, frontend/sample_text.h) on a real tokenizer
// (SmolLM2's GGUF): a sample's deltas add up to the tokenizer's own Decode, a stop string split
// across tokens cuts the text where a whole-text search would, replaying a resumed sample's
// tokens leaves its text where a continuous stream's was, and a chat prompt is its template's
// text encoded as it is.
#include "frontend/sample_text.h"

#include <gtest/gtest.h>

#include "frontend/prompt.h"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

class SampleTextTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto t = Tokenizer::Load(testing::SmolLm2Path());
    ASSERT_TRUE(t.ok()) << t.status();
    tokenizer_ = t->release();
  }
  static void TearDownTestSuite() { delete tokenizer_; }
  static const Tokenizer* tokenizer_;
};
const Tokenizer* SampleTextTest::tokenizer_ = nullptr;

// Text with multi-byte characters, so that some tokens end inside a UTF-8 character.
constexpr char kText[] =
    "Grüße aus Zürich: 東京 and 🙂 emoji, then the end. More text after.";

std::string All(SampleText& text, const std::vector<int32_t>& ids, size_t from = 0) {
  std::string out;
  for (size_t i = from; i < ids.size(); ++i) out += text.Add(ids[i]);
  return out + text.Finish();
}

TEST_F(SampleTextTest, DeltasAddUpToTheDecodedText) {
  const std::vector<int32_t> ids = tokenizer_->Encode(kText);
  SampleText text(tokenizer_, /*skip_special=*/true, {}, false);
  EXPECT_EQ(All(text, ids), tokenizer_->Decode(ids));
  EXPECT_FALSE(text.stopped());
}

TEST_F(SampleTextTest, AStopStringCutsTheTextWhereASearchOfTheWholeTextWould) {
  const std::vector<int32_t> ids = tokenizer_->Encode(kText);
  const std::string whole = tokenizer_->Decode(ids);
  for (const bool include : {false, true}) {
    SampleText text(tokenizer_, true, {"the end", "東京"}, include);
    std::string out;
    size_t consumed = 0;
    for (int32_t id : ids) {
      out += text.Add(id);
      ++consumed;
      if (text.stopped()) break;
    }
    out += text.Finish();
    ASSERT_TRUE(text.stopped());
    EXPECT_EQ(text.matched_stop(), "東京");  // the earlier in the text wins
    const size_t at = whole.find("東京");
    EXPECT_EQ(out, whole.substr(0, include ? at + std::string("東京").size() : at));
    EXPECT_LT(consumed, ids.size());
    EXPECT_EQ(text.Add(ids.back()), "");  // nothing after a stop
  }
}

TEST_F(SampleTextTest, ReplayingResumedTokensContinuesAsOneStream) {
  const std::vector<int32_t> ids = tokenizer_->Encode(kText);
  for (size_t k = 0; k <= ids.size(); ++k) {
    SampleText one(tokenizer_, true, {"More"}, false);
    std::string after;  // what one stream sends from token k on
    for (size_t i = 0; i < ids.size(); ++i) {
      const std::string d = one.Add(ids[i]);
      if (i >= k) after += d;
    }
    after += one.Finish();
    SampleText resumed(tokenizer_, true, {"More"}, false);
    for (size_t i = 0; i < k; ++i) resumed.Add(ids[i]);  // sent by the failed worker
    EXPECT_EQ(All(resumed, ids, k), after) << "resumed after " << k << " tokens";
  }
}

TEST_F(SampleTextTest, WithoutATokenizerASampleHasNoText) {
  SampleText text(nullptr, true, {}, false);
  EXPECT_FALSE(text.has_text());
  EXPECT_EQ(text.Add(42), "");
  EXPECT_EQ(text.Finish(), "");
}

TEST_F(SampleTextTest, PromptsFromTextAndFromAConversation) {
  auto text = EncodeTextPrompt(*tokenizer_, "Hello");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, tokenizer_->Encode("Hello", /*add_special=*/true));
  EXPECT_EQ(EncodeTextPrompt(*tokenizer_, "").status().code(), absl::StatusCode::kInvalidArgument);

  const std::vector<ChatMessage> chat = {{"system", "Be brief."}, {"user", "Hi!"}};
  auto rendered = RenderChat(*tokenizer_, chat);
  ASSERT_TRUE(rendered.ok()) << rendered.status();
  EXPECT_NE(rendered->find("<|im_start|>user\nHi!<|im_end|>"), std::string::npos) << *rendered;
  EXPECT_TRUE(rendered->ends_with("<|im_start|>assistant\n")) << *rendered;
  auto ids = EncodeChatPrompt(*tokenizer_, chat);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, tokenizer_->Encode(*rendered, /*add_special=*/false));
  auto llama3 = RenderChat(*tokenizer_, chat, "llama3");
  ASSERT_TRUE(llama3.ok()) << llama3.status();
  EXPECT_NE(llama3->find("<|start_header_id|>user<|end_header_id|>"), std::string::npos);
  EXPECT_EQ(RenderChat(*tokenizer_, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(RenderChat(*tokenizer_, chat, "no-such-format").ok());
}

TEST(PromptLength, TheLeastOfTheServersTheModelsAndTheCallersLimit) {
  EXPECT_TRUE(CheckPromptLength(100, 0, 100).ok());
  EXPECT_FALSE(CheckPromptLength(101, 0, 100).ok());
  EXPECT_FALSE(CheckPromptLength(101, 500, 100).ok());  // the context caps the server's
  EXPECT_FALSE(CheckPromptLength(51, 50, 100).ok());
  EXPECT_TRUE(CheckPromptLength(50, 50, 100).ok());
  const absl::Status st = CheckPromptLength(41, 50, 100, 40);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("max_prompt_tokens) is 40"), std::string::npos) << st;
}

}  // namespace
}  // namespace infinigen
