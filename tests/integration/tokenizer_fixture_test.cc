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
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

struct Case {
  std::string name;      // fixture file stem
  std::string path;      // tokenizer to load
  bool lossless;         // decode(encode(x)) == x for every valid x
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
  int rows = 0, ids_ok = 0, special_ok = 0, decode_ok = 0, roundtrip_ok = 0;
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
  }
  RecordProperty("rows", rows);
  EXPECT_GE(rows, 300);
  EXPECT_EQ(ids_ok, rows) << first_failure;
  EXPECT_EQ(special_ok, rows);
  EXPECT_EQ(decode_ok, rows);
  if (c.lossless) EXPECT_EQ(roundtrip_ok, rows);
}

INSTANTIATE_TEST_SUITE_P(
    References, TokenizerFixture,
    ::testing::Values(
        Case{"llama3.1", testing::SharedTestdataPath("tokenizers/llama3.1"), true},
        Case{"mistral-7b", testing::SharedTestdataPath("tokenizers/mistral-7b"), false},
        Case{"gpt2", testing::SharedTestdataPath("tokenizers/gpt2"), true},
        Case{"llama2-spm", testing::SharedTestdataPath("tokenizers/llama2-spm/tokenizer.model"),
             false},
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
