// The JSON prefix recognizer behind response_format json_object, against nlohmann::json's parser
// (an independent one): every prefix of a valid document is accepted and only the whole is
// complete; random edits of documents are complete exactly when nlohmann accepts them (within
// the recognizer's two documented limits); and the token mask over a small vocabulary lets
// through exactly the tokens that continue the text.
#include "gpu_worker/structured/json_prefix.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gpu_worker/structured/json_token_mask.h"
#include "nlohmann/json.hpp"

namespace infinigen {
namespace {

using nlohmann::json;

bool Whole(const std::string& text, bool object_only = true) {
  JsonPrefix p(object_only);
  return p.Feed(text) && p.Complete();
}

// How far the recognizer reads `text`: its length when it takes every byte.
size_t Accepted(const std::string& text) {
  JsonPrefix p;
  for (size_t i = 0; i < text.size(); ++i) {
    if (!p.Feed(static_cast<uint8_t>(text[i]))) return i;
  }
  return text.size();
}

TEST(JsonPrefix, WritesOutTheGrammar) {
  for (const char* ok :
       {R"({})", R"( {"a":1})",
        "{\n  \"a\": [1, 2.5e-3, -0, 0.0E+7, true, false, null],\n  \"b\": {}\n}",
        R"({"s":"\"\\\/\b\f\n\r\t\u00e9\ud83d\ude00"})",
        "{\"u\":\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"}", R"({"a":[[],[{}],[[1]]]})"}) {
    EXPECT_TRUE(Whole(ok)) << ok;
  }
  for (const char* bad : {R"([])",
                          R"("x")",
                          R"(1)",
                          R"({"a":01})",
                          R"({"a":1.})",
                          R"({"a":-})",
                          R"({"a":.5})",
                          R"({"a":1e})",
                          R"({"a":+1})",
                          "{\"a\":\"\x01\"}",
                          R"({"a":"\ud800"})",
                          R"({"a":"\udc00"})",
                          R"({"a":"\ud800\u0041"})",
                          R"({"a":"\x"})",
                          R"({"a":"\u12g4"})",
                          R"({a:1})",
                          R"({"a" 1})",
                          R"({"a":1,})",
                          R"({"a":1 "b":2})",
                          R"({} )",
                          R"({}{})",
                          R"({"a":tru})",
                          R"({"a":nul})",
                          R"({"a":[1,]})",
                          R"({"a":[1}})",
                          R"({"a":{]})",
                          "{\"a\":\"\xc0\xaf\"}",
                          "{\"a\":\"\xed\xa0\x80\"}",
                          "{\"a\":\"\xf4\x90\x80\x80\"}",
                          "{\"a\":\"\xe2\x82\"}",
                          "{\"a\":\"\x80\"}",
                          "{\"a\":\"\xff\"}"}) {
    EXPECT_FALSE(Whole(bad)) << bad;
    EXPECT_FALSE(json::accept(bad) && bad[0] == '{' && bad[std::string(bad).size() - 1] == '}')
        << "the case itself is valid JSON: " << bad;
  }
  // Not whole yet, but a document can still follow.
  for (const char* open : {R"({)", R"({"a)", R"({"a":)", R"({"a":[1,)", R"({"a":1)", R"({"a":-)",
                           R"({"a":"\u00)", R"({"a":"\ud83d)", R"({"a":"\ud83d\)"}) {
    JsonPrefix p;
    EXPECT_TRUE(p.Feed(open)) << open;
    EXPECT_FALSE(p.Complete()) << open;
  }
  EXPECT_TRUE(Whole("-12.5e3", /*object_only=*/false));
  EXPECT_TRUE(Whole("[true]", /*object_only=*/false));
  EXPECT_FALSE(Whole("-", /*object_only=*/false));
  // The two limits: nesting and whitespace runs.
  const std::string deep(JsonPrefix::kMaxDepth - 1, '[');  // inside the object
  EXPECT_EQ(Accepted("{\"a\":" + deep), 5 + deep.size());
  EXPECT_EQ(Accepted("{\"a\":" + deep + "["), 5 + deep.size());
  EXPECT_EQ(Accepted("{" + std::string(JsonPrefix::kMaxWhitespaceRun, ' ') + "}"),
            2 + JsonPrefix::kMaxWhitespaceRun);
  EXPECT_EQ(Accepted("{" + std::string(JsonPrefix::kMaxWhitespaceRun + 1, '\n') + "}"),
            1 + JsonPrefix::kMaxWhitespaceRun);
}

// A random JSON value: objects, arrays, strings (escapes, non-ASCII), numbers, literals.
json RandomValue(std::mt19937& rng, int depth) {
  std::uniform_int_distribution<int> kind(0, depth >= 4 ? 4 : 6);
  switch (kind(rng)) {
    case 0:
      return json(static_cast<int64_t>(rng() % 2000) - 1000);
    case 1:
      return json(std::ldexp(static_cast<double>(rng() % 100000) - 50000, -(int)(rng() % 20)));
    case 2:
      return json(rng() % 2 == 0);
    case 3:
      return json(nullptr);
    case 4: {
      static const std::vector<std::string> pieces = {
          "a",  "Zz", " ",    "\"",       "\\",           "/",
          "\n", "\t", "\x01", "\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x98\x80",
          "{[", "1e5"};
      std::string s;
      for (int i = static_cast<int>(rng() % 5); i > 0; --i) s += pieces[rng() % pieces.size()];
      return json(s);
    }
    case 5: {
      json a = json::array();
      for (int i = static_cast<int>(rng() % 4); i > 0; --i)
        a.push_back(RandomValue(rng, depth + 1));
      return a;
    }
    default: {
      json o = json::object();
      for (int i = static_cast<int>(rng() % 4); i > 0; --i) {
        o[std::string(1, static_cast<char>('a' + rng() % 26))] = RandomValue(rng, depth + 1);
      }
      return o;
    }
  }
}

std::string RandomDocument(std::mt19937& rng) {
  json doc = json::object();
  for (int i = static_cast<int>(rng() % 4); i > 0; --i) {
    doc[std::string(1 + rng() % 3, static_cast<char>('k' + rng() % 8))] = RandomValue(rng, 1);
  }
  const int indent = static_cast<int>(rng() % 3) - 1;  // -1: compact
  return doc.dump(indent, ' ', /*ensure_ascii=*/rng() % 2 == 0);
}

TEST(JsonPrefix, EveryPrefixOfADocumentIsAcceptedAndOnlyTheWholeIsComplete) {
  std::mt19937 rng(7);
  for (int n = 0; n < 500; ++n) {
    const std::string doc = RandomDocument(rng);
    JsonPrefix p;
    for (size_t i = 0; i < doc.size(); ++i) {
      ASSERT_FALSE(p.Complete()) << doc.substr(0, i);
      ASSERT_TRUE(p.Feed(static_cast<uint8_t>(doc[i]))) << "byte " << i << " of " << doc;
    }
    EXPECT_TRUE(p.Complete()) << doc;
  }
}

// The longest run of whitespace outside strings, and the deepest nesting, of a text nlohmann
// accepts (the recognizer's limits).
std::pair<int, int> WhitespaceRunAndDepth(const std::string& text) {
  int run = 0, longest = 0, depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    const bool space = c == ' ' || c == '\n' || c == '\t' || c == '\r';
    run = space ? run + 1 : 0;
    longest = std::max(longest, run);
    if (c == '"') in_string = true;
    if (c == '{' || c == '[') deepest = std::max(deepest, ++depth);
    if (c == '}' || c == ']') --depth;
  }
  return {longest, deepest};
}

TEST(JsonPrefix, EditedDocumentsAreWholeExactlyWhenNlohmannAcceptsThem) {
  std::mt19937 rng(11);
  const std::string alphabet = "{}[]\":,\\/u0123456789abcdefEe.+- \n\tntrlsx\x01\x7f";
  const std::vector<std::string> bytes = {"\xc3", "\xa9", "\xed", "\xa0",    "\x80",   "\xf0",
                                          "\x9f", "\xc0", "\xff", "\\ud800", "\\udc00"};
  int whole = 0, refused = 0;  // the cases compared
  for (int n = 0; n < 20000; ++n) {
    std::string doc = RandomDocument(rng);
    for (int edits = 1 + static_cast<int>(rng() % 3); edits > 0; --edits) {
      const size_t at = rng() % (doc.size() + 1);
      const std::string piece = rng() % 4 == 0 ? bytes[rng() % bytes.size()]
                                               : std::string(1, alphabet[rng() % alphabet.size()]);
      switch (rng() % 3) {
        case 0:
          doc.insert(at, piece);
          break;
        case 1:
          if (at < doc.size()) doc.erase(at, 1);
          break;
        default:
          if (at < doc.size()) doc.replace(at, 1, piece);
      }
    }
    const size_t start = doc.find_first_not_of(" \n\t\r");
    const auto [run, depth] = WhitespaceRunAndDepth(doc);
    // nlohmann refuses numbers past a double's range, which JSON's grammar has not.
    bool accepted = true;
    try {
      [[maybe_unused]] const json parsed = json::parse(doc);
    } catch (const json::exception& e) {
      accepted = false;
      if (std::string(e.what()).find("overflow") != std::string::npos) continue;
    }
    const bool want = accepted && start != std::string::npos && doc[start] == '{' &&
                      doc.back() == '}' && run <= JsonPrefix::kMaxWhitespaceRun &&
                      depth <= JsonPrefix::kMaxDepth;
    ASSERT_EQ(Whole(doc), want) << doc;
    (want ? whole : refused) += 1;
  }
  EXPECT_GT(whole, 1000);
  EXPECT_GT(refused, 10000);
}

TEST(JsonTokenMask, LetsThroughTheTokensThatContinueTheObject) {
  auto vocabulary = std::make_shared<JsonVocabulary>();
  const std::vector<std::string> tokens = {"{",   "}",   "\"", "a", ":",     "1", " ",
                                           "{\"", "\"}", "x",  "",  "<eos>", "]"};
  for (const std::string& t : tokens) {
    vocabulary->bytes.push_back(t);
    vocabulary->usable.push_back(t.empty() || t == "<eos>" ? 0 : 1);
  }
  vocabulary->Classify();
  const int32_t eos = 11;
  JsonTokenMask mask(vocabulary);
  auto allowed = [&] {
    std::vector<float> row(tokens.size() + 2, 0.0f);  // two ids past the tokenizer's
    row[9] = -INFINITY;                               // masked before (logit_bias)
    EXPECT_TRUE(mask.Mask(row, std::vector<int32_t>{eos}));
    std::string out;
    for (size_t id = 0; id < row.size(); ++id) {
      if (row[id] != -INFINITY) out += std::to_string(id) + ",";
    }
    return out;
  };
  EXPECT_EQ(allowed(), "0,6,7,");  // "{", " ", "{\""
  ASSERT_TRUE(mask.Accept(0));
  EXPECT_EQ(allowed(), "1,2,6,8,");  // "}", "\"", " ", "\"}" (a key that starts with '}')
  ASSERT_TRUE(mask.Accept(2));
  // Inside a key: any text ("x" was masked), but not a key closed by '}'.
  EXPECT_EQ(allowed(), "0,1,2,3,4,5,6,7,12,");
  ASSERT_TRUE(mask.Accept(3));
  ASSERT_TRUE(mask.Accept(2));
  EXPECT_EQ(allowed(), "4,6,");  // ":", " "
  EXPECT_FALSE(mask.Accept(5)) << "a value before the colon";
  JsonTokenMask whole(vocabulary);
  ASSERT_TRUE(whole.Accept(0));
  ASSERT_TRUE(whole.Accept(1));
  EXPECT_TRUE(whole.Complete());
  std::vector<float> row(tokens.size(), 0.0f);
  EXPECT_TRUE(whole.Mask(row, std::vector<int32_t>{eos}));
  for (size_t id = 0; id < row.size(); ++id) {
    EXPECT_EQ(row[id] != -INFINITY, static_cast<int32_t>(id) == eos) << id;
  }
  std::vector<float> none(tokens.size(), 0.0f);
  EXPECT_FALSE(whole.Mask(none, {})) << "nothing may follow a whole object but a stop token";
  // A stop token with bytes (a user's stop_token_ids) may come where it continues the text:
  // "}" (id 1) right after "{", not at the start.
  JsonTokenMask cut(vocabulary);
  std::vector<float> start(tokens.size(), 0.0f);
  ASSERT_TRUE(cut.Mask(start, std::vector<int32_t>{1, eos}));
  EXPECT_EQ(start[1], -INFINITY);
  EXPECT_EQ(start[eos], -INFINITY);
  ASSERT_TRUE(cut.Accept(0));
  std::vector<float> open(tokens.size(), 0.0f);
  ASSERT_TRUE(cut.Mask(open, std::vector<int32_t>{1, eos}));
  EXPECT_EQ(open[1], 0.0f);
  EXPECT_EQ(open[eos], -INFINITY);
}

// The mask's shortcuts (first bytes, tokens plain inside strings) against reading every token
// from every state: a vocabulary of the pieces of random documents (and of their edits), at
// every byte of other documents.
TEST(JsonTokenMask, EqualsReadingEveryToken) {
  std::mt19937 rng(5);
  auto vocabulary = std::make_shared<JsonVocabulary>();
  std::set<std::string> pieces;
  for (int n = 0; n < 60; ++n) {
    const std::string doc = RandomDocument(rng);
    for (size_t at = 0; at < doc.size(); ++at) {
      for (size_t len = 1; len <= 5 && at + len <= doc.size(); ++len)
        pieces.insert(doc.substr(at, len));
    }
  }
  for (const char* odd : {"\xc3", "\xa9", "\x01", "\"}", "\\u", "\xf0\x9f", "\x98\x80"})
    pieces.insert(odd);
  for (const std::string& p : pieces) {
    vocabulary->bytes.push_back(p);
    vocabulary->usable.push_back(1);
  }
  vocabulary->bytes.push_back("");
  vocabulary->usable.push_back(0);
  vocabulary->Classify();
  int plain = 0;
  for (uint8_t x : vocabulary->plain) plain += x;
  EXPECT_GT(plain, 100);
  for (int n = 0; n < 20; ++n) {
    const std::string doc = RandomDocument(rng);
    JsonTokenMask mask(vocabulary);
    JsonPrefix state;
    for (size_t i = 0; i < doc.size(); ++i) {
      std::vector<float> row(vocabulary->bytes.size(), 0.0f);
      ASSERT_TRUE(mask.Mask(row, {}));
      for (size_t id = 0; id < row.size(); ++id) {
        JsonPrefix next = state;
        const bool want = vocabulary->usable[id] != 0 && next.Feed(vocabulary->bytes[id]);
        ASSERT_EQ(row[id] != -INFINITY, want)
            << "token '" << vocabulary->bytes[id] << "' after '" << doc.substr(0, i) << "'";
      }
      const std::string one = doc.substr(i, 1);
      const auto it = pieces.find(one);
      ASSERT_NE(it, pieces.end());
      ASSERT_TRUE(mask.Accept(static_cast<int32_t>(std::distance(pieces.begin(), it))));
      ASSERT_TRUE(state.Feed(static_cast<uint8_t>(doc[i])));
    }
    EXPECT_TRUE(mask.Complete());
  }
}

}  // namespace
}  // namespace infinigen
