// Every tokenizer against its reference implementation on the committed strings
// (scripts/fixtures/make_tokenizer_fixtures.py): Hugging Face tokenizers for tokenizer.json and
// vocab.json + merges.txt, sentencepiece for tokenizer.model, and for the SmolLM2 GGUF a
// tokenizers BPE built from the GGUF's own vocabulary. Ids must agree exactly, with and without
// special tokens; decoding must agree with the reference and give back the input.
#include <gtest/gtest.h>

#include <fstream>
#include <memory>

#include "absl/strings/escaping.h"
#include "gpu_worker/tokenizer/tokenizer.h"
#include "gpu_worker/tokenizer/unicode.h"
#include "nlohmann/json.hpp"
#include "tests/support/gguf_writer.h"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

struct Case {
  std::string name;  // fixture file stem
  std::string path;  // tokenizer to load
  // decode(encode(x)) == x for every valid x. Not for tokenizer.json files of the
  // SentencePiece style: the text after a special token gets its own dummy-prefix space
  // ("a<s>b" decodes to "a<s> b"), as in Hugging Face.
  bool lossless;
};

std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }

class TokenizerFixture : public ::testing::TestWithParam<Case> {};

TEST_P(TokenizerFixture, IdsAndTextMatchTheReference) {
  const Case& c = GetParam();
  IG_REQUIRE_FILE(c.path, "tokenizer");
  auto tok = Tokenizer::Load(c.path);
  ASSERT_TRUE(tok.ok()) << tok.status();
  std::ifstream in(testing::FixturePath("tokenizers/" + c.name + ".jsonl"));
  ASSERT_TRUE(in.good());
  std::string line;
  int rows = 0, ids_ok = 0, special_ok = 0, decode_ok = 0, roundtrip_ok = 0, stream_ok = 0;
  std::string first_failure;
  while (std::getline(in, line)) {
    const auto row = nlohmann::json::parse(line);
    const std::string bytes = absl::HexStringToBytes(row["text_hex"].get<std::string>());
    const auto want = row["ids"].get<std::vector<int32_t>>();
    const auto want_special = row["ids_special"].get<std::vector<int32_t>>();
    const auto got = (*tok)->Encode(bytes, false);
    ++rows;
    if (got == want) {
      ++ids_ok;
    } else if (first_failure.empty()) {
      first_failure = "ids differ for " + row["text_hex"].get<std::string>();
    }
    special_ok += (*tok)->Encode(bytes, true) == want_special;
    decode_ok += (*tok)->Decode(want) == row["decoded"].get<std::string>();
    roundtrip_ok += (*tok)->Decode(got) == unicode::SanitizeUtf8(bytes);
    // Streaming: every delta is whole UTF-8 and the deltas add up to Decode().
    IncrementalDecoder stream(**tok, /*skip_special=*/false);
    std::string streamed;
    bool whole = true;
    for (int32_t id : want) {
      const std::string delta = stream.Add(id);
      whole = whole && unicode::SanitizeUtf8(delta) == delta;
      streamed += delta;
    }
    streamed += stream.Finish();
    stream_ok += whole && streamed == (*tok)->Decode(want);
  }
  RecordProperty("rows", rows);
  EXPECT_GE(rows, 300);
  EXPECT_EQ(ids_ok, rows) << first_failure;
  EXPECT_EQ(special_ok, rows);
  EXPECT_EQ(decode_ok, rows);
  EXPECT_EQ(stream_ok, rows);
  if (c.lossless) {
    EXPECT_EQ(roundtrip_ok, rows);
  }
}

// A GGUF "llama" (SentencePiece) vocabulary made from Llama 2's tokenizer.model must tokenize as
// sentencepiece does (except that GGUF vocabularies recognize control tokens in text).
TEST(GgufTokenizer, LlamaVocabularyMatchesSentencePiece) {
  const std::string model = testing::SharedTestdataPath("tokenizers/llama2-spm/tokenizer.model");
  IG_REQUIRE_FILE(model, "Llama 2 tokenizer.model");
  std::ifstream f(model, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto sp = ParseSentencePieceModel(bytes);
  ASSERT_TRUE(sp.ok()) << sp.status();
  testing::GgufWriter w;
  w.AddString("general.architecture", "llama");
  w.AddString("tokenizer.ggml.model", "llama");
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  std::vector<float> scores;
  for (const auto& p : sp->pieces) {
    tokens.push_back(p.text);
    types.push_back(static_cast<int32_t>(p.type));
    scores.push_back(p.score);
  }
  w.AddStringArray("tokenizer.ggml.tokens", tokens);
  w.AddI32Array("tokenizer.ggml.token_type", types);
  w.AddF32Array("tokenizer.ggml.scores", scores);
  w.AddU32("tokenizer.ggml.bos_token_id", 1);
  w.AddU32("tokenizer.ggml.eos_token_id", 2);
  const std::string path = ::testing::TempDir() + "/llama2_vocab.gguf";
  testing::WriteFile(path, w.Build());
  auto tok = Tokenizer::Load(path);
  ASSERT_TRUE(tok.ok()) << tok.status();
  std::ifstream in(testing::FixturePath("tokenizers/llama2-spm.jsonl"));
  std::string line;
  int compared = 0, equal = 0;
  while (std::getline(in, line)) {
    const auto row = nlohmann::json::parse(line);
    const std::string text = absl::HexStringToBytes(row["text_hex"].get<std::string>());
    if (text.find("<s>") != std::string::npos || text.find("</s>") != std::string::npos) continue;
    ++compared;
    equal += (*tok)->Encode(text, false) == row["ids"].get<std::vector<int32_t>>();
  }
  EXPECT_GT(compared, 300);
  EXPECT_EQ(equal, compared);
  EXPECT_EQ((*tok)->Encode("<s>hi", false).front(), 1);  // control token recognized in text
  EXPECT_EQ((*tok)->Encode("hi", true).front(), 1);      // BOS added by default
}

INSTANTIATE_TEST_SUITE_P(
    References, TokenizerFixture,
    ::testing::Values(
        Case{"llama3.1", testing::SharedTestdataPath("tokenizers/llama3.1"), true},
        Case{"mistral-7b", testing::SharedTestdataPath("tokenizers/mistral-7b"), false},
        Case{"gpt2", testing::SharedTestdataPath("tokenizers/gpt2"), true},
        Case{"llama2-spm", testing::SharedTestdataPath("tokenizers/llama2-spm/tokenizer.model"),
             true},
        Case{"smollm2-gguf", testing::SmolLm2Path(), true}),
    [](const ::testing::TestParamInfo<Case>& info) {
      std::string n = info.param.name;
      for (char& ch : n) {
        if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
      }
      return n;
    });

}  // namespace
}  // namespace infinigen
