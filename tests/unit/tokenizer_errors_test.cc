// Malformed tokenizer files give errors that say what is wrong; UTF-8 helpers.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "gpu_worker/tokenizer/tokenizer.h"
#include "gpu_worker/tokenizer/unicode.h"
#include "tests/support/gguf_writer.h"

namespace infinigen {
namespace {

namespace fs = std::filesystem;

std::string Write(const std::string& name, const std::string& content) {
  const fs::path dir = fs::temp_directory_path() / "infinigen_tok_errors";
  fs::create_directories(dir);
  const std::string path = (dir / name).string();
  std::ofstream(path, std::ios::binary) << content;
  return path;
}

void ExpectError(const absl::StatusOr<std::unique_ptr<Tokenizer>>& t,
                 std::initializer_list<std::string> words) {
  ASSERT_FALSE(t.ok());
  for (const auto& w : words) {
    EXPECT_NE(t.status().message().find(w), std::string::npos) << w << " not in " << t.status();
  }
}

constexpr char kMinimal[] = R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2},
  "merges": ["a b"]}, "pre_tokenizer": {"type": "ByteLevel", "use_regex": true},
  "decoder": {"type": "ByteLevel"}})";

TEST(TokenizerErrors, MinimalTokenizerJsonWorks) {
  auto t = Tokenizer::Load(Write("ok.json", kMinimal));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->Encode("ab"), (std::vector<int32_t>{2}));
  EXPECT_EQ((*t)->Decode({{2, 0}}), "aba");
}

TEST(TokenizerErrors, MalformedFilesAreNamed) {
  ExpectError(Tokenizer::Load(Write("bad.json", "{not json")), {"bad.json", "not valid JSON"});
  ExpectError(Tokenizer::Load(Write("nomodel.json", "{}")), {"nomodel.json", "malformed"});
  ExpectError(Tokenizer::Load(Write("merge.json",
                                    R"({"model": {"type": "BPE", "vocab": {"a": 0},
                                        "merges": ["a c"]}, "decoder": {"type": "ByteLevel"}})")),
              {"merge.json", "\"a\" + \"c\"", "missing from the vocabulary"});
  ExpectError(
      Tokenizer::Load(Write("wordpiece.json", R"({"model": {"type": "WordPiece", "vocab": {}}})")),
      {"model type WordPiece", "not supported"});
  ExpectError(Tokenizer::Load(Write("nfkc.json",
                                    R"({"model": {"type": "BPE", "vocab": {}, "merges": []},
                                        "normalizer": {"type": "NFKC"},
                                        "decoder": {"type": "ByteLevel"}})")),
              {"NFKC", "not supported"});
  ExpectError(Tokenizer::Load(Write("regex.json",
                                    R"({"model": {"type": "BPE", "vocab": {}, "merges": []},
                                        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\w+"},
                                        "behavior": "Isolated", "invert": false},
                                        "decoder": {"type": "ByteLevel"}})")),
              {"regex", "\\w+"});
  ExpectError(Tokenizer::Load(Write("garbage.model", std::string("\x0a\xff\xff\xff", 4))),
              {"garbage.model", "not a valid SentencePiece model"});
  ExpectError(Tokenizer::Load("/no/such/tokenizer.json"), {"/no/such/tokenizer.json"});
}

// Found by fuzzing (tests/fuzz/tokenizer_files_fuzz.cc): ids that are negative or huge
// indexed before the id table or sized it from the file, and a "Sequence" decoder without its
// "decoders" read a missing key of a const JSON object (use after free).
TEST(TokenizerErrors, BadIdsAndMissingKeysAreErrors) {
  for (const char* id : {"-3", "2147483648", "99999999999"}) {
    ExpectError(Tokenizer::Load(
                    Write("id.json", std::string(R"({"model": {"type": "BPE",
        "vocab": {"a": 0, "b": )") + id +
                                         R"(}, "merges": []}, "decoder": {"type": "ByteLevel"}})")),
                {"id.json", "token b has the id"});
  }
  const std::string dir = fs::path(Write("vocab.json", R"({"a": 0, "b": -1})")).parent_path();
  Write("merges.txt", "");
  ExpectError(Tokenizer::Load(dir), {"vocab.json", "token b has the id -1"});
  ExpectError(Tokenizer::Load(Write("seq.json",
                                    R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
                                        "decoder": {"type": "Sequence"}})")),
              {"seq.json", "malformed"});
}

TEST(TokenizerErrors, GgufTokenizerKindsAreChecked) {
  testing::GgufWriter w;
  w.AddString("tokenizer.ggml.model", "bert");
  w.AddStringArray("tokenizer.ggml.tokens", {"a"});
  testing::WriteFile(Write("bert.gguf", ""), w.Build());
  ExpectError(Tokenizer::Load(fs::temp_directory_path() / "infinigen_tok_errors" / "bert.gguf"),
              {"bert", "not supported"});
  testing::GgufWriter p;
  p.AddString("tokenizer.ggml.model", "gpt2");
  p.AddString("tokenizer.ggml.pre", "deepseek-coder");
  p.AddStringArray("tokenizer.ggml.tokens", {"a"});
  testing::WriteFile(Write("pre.gguf", ""), p.Build());
  ExpectError(Tokenizer::Load(fs::temp_directory_path() / "infinigen_tok_errors" / "pre.gguf"),
              {"deepseek-coder", "not supported"});
}

TEST(Unicode, SanitizeReplacesMaximalInvalidSubsequences) {
  EXPECT_EQ(unicode::SanitizeUtf8("ok"), "ok");
  EXPECT_EQ(unicode::SanitizeUtf8("a\xff"
                                  "b"),
            "a\xEF\xBF\xBD"
            "b");
  // A truncated 3-byte sequence is one replacement; a bad continuation restarts decoding.
  EXPECT_EQ(unicode::SanitizeUtf8("\xE2\x82"), "\xEF\xBF\xBD");
  EXPECT_EQ(unicode::SanitizeUtf8("\xC3\x28"), "\xEF\xBF\xBD(");
  // Surrogates and overlongs are invalid byte by byte.
  EXPECT_EQ(unicode::SanitizeUtf8("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(unicode::SanitizeUtf8("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(Unicode, CompletePrefixHoldsBackOnlyUnfinishedSequences) {
  EXPECT_EQ(unicode::CompleteUtf8Prefix("abc"), 3u);
  EXPECT_EQ(unicode::CompleteUtf8Prefix("ab\xE4\xBD"), 2u);
  EXPECT_EQ(unicode::CompleteUtf8Prefix("\xF0\x9F\x98"), 0u);
  EXPECT_EQ(unicode::CompleteUtf8Prefix("\xF0\x9F\x98\x80"), 4u);
  EXPECT_EQ(unicode::CompleteUtf8Prefix("a\xFF"), 2u);  // can never complete: let it through
}

}  // namespace
}  // namespace infinigen
