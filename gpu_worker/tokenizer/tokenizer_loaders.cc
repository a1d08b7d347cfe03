// Builds TokenizerSpecs from the files models ship: Hugging Face tokenizer.json (+
// tokenizer_config.json), vocab.json + merges.txt, SentencePiece tokenizer.model, and the
// tokenizer inside a GGUF. Anything a file asks for that is not implemented is an error that
// names it, never a silently different tokenization.
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "gpu_worker/model/gguf.h"
#include "gpu_worker/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

namespace infinigen {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr char kSpaceSymbol[] = "\xE2\x96\x81";

// Vocabulary ids come from files: an integer in [0, kMaxVocabId), else an error naming the token
// (a negative id indexed before the table, and a huge one sized it: found by fuzzing).
constexpr int64_t kMaxVocabId = int64_t{1} << 24;
absl::StatusOr<int32_t> VocabId(const nlohmann::json& id, const std::string& path,
                                const std::string& token) {
  if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= kMaxVocabId) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": token ", token, " has the id ",
                                                   id.dump(), "; ids are integers in [0, ",
                                                   kMaxVocabId, ")"));
  }
  return static_cast<int32_t>(id.get<int64_t>());
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<json> ReadJson(const std::string& path) {
  IG_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON"));
  return j;
}

absl::Status Unsupported(const std::string& path, const std::string& what) {
  return absl::UnimplementedError(absl::StrCat(path, ": ", what, " is not supported"));
}

// A token given as a string or as {"content": ...} in tokenizer_config.json.
std::string TokenString(const json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string()) {
    return j["content"].get<std::string>();
  }
  return "";
}

// Settings from tokenizer_config.json that override or complete the tokenizer file.
struct TokenizerConfig {
  std::optional<bool> add_bos, add_eos;
  std::string bos_token, eos_token, chat_template;
  std::vector<AddedToken> added;  // from added_tokens_decoder
};

absl::StatusOr<TokenizerConfig> ReadTokenizerConfig(const std::string& path) {
  TokenizerConfig c;
  std::error_code ec;
  if (!fs::exists(path, ec)) return c;
  IG_ASSIGN_OR_RETURN(json j, ReadJson(path));
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": not an object"));
  if (j.contains("add_bos_token") && j["add_bos_token"].is_boolean())
    c.add_bos = j["add_bos_token"];
  if (j.contains("add_eos_token") && j["add_eos_token"].is_boolean())
    c.add_eos = j["add_eos_token"];
  if (j.contains("bos_token")) c.bos_token = TokenString(j["bos_token"]);
  if (j.contains("eos_token")) c.eos_token = TokenString(j.at("eos_token"));
  if (j.contains("chat_template")) {
    const json& t = j.at("chat_template");
    if (t.is_string()) c.chat_template = t.get<std::string>();
    if (t.is_array()) {  // [{"name": "default", "template": ...}, ...]
      for (const json& e : t) {
        if (e.value("name", "") == "default" && e.contains("template")) {
          c.chat_template = e.at("template").get<std::string>();
        }
      }
    }
  }
  if (j.contains("added_tokens_decoder") && j.at("added_tokens_decoder").is_object()) {
    for (auto& [id, tok] : j.at("added_tokens_decoder").items()) {
      AddedToken a;
      a.id = std::atoi(id.c_str());
      a.content = tok.value("content", "");
      a.special = tok.value("special", false);
      a.lstrip = tok.value("lstrip", false);
      a.rstrip = tok.value("rstrip", false);
      c.added.push_back(a);
    }
  }
  return c;
}

// bos/eos ids and the add_bos/add_eos post-processing from tokenizer_config.json.
void ApplyConfig(const TokenizerConfig& c, const absl::flat_hash_map<std::string, int32_t>& ids,
                 TokenizerSpec& spec) {
  auto id_of = [&](const std::string& t) -> int32_t {
    for (const AddedToken& a : spec.added) {
      if (a.content == t) return a.id;
    }
    auto it = ids.find(t);
    return it == ids.end() ? -1 : it->second;
  };
  if (!c.bos_token.empty()) spec.bos_id = id_of(c.bos_token);
  if (!c.eos_token.empty()) {
    const int32_t eos = id_of(c.eos_token);
    if (eos >= 0) spec.eos_ids = {eos};
  }
  if (c.add_bos.has_value()) {
    spec.prefix_ids.clear();
    if (*c.add_bos && spec.bos_id >= 0) spec.prefix_ids = {spec.bos_id};
  }
  if (c.add_eos.has_value()) {
    spec.suffix_ids.clear();
    if (*c.add_eos && !spec.eos_ids.empty()) spec.suffix_ids = {spec.eos_ids[0]};
  }
  if (!c.chat_template.empty()) spec.chat_template = c.chat_template;
}

absl::Status ParseNormalizer(const json& n, const std::string& path, TokenizerSpec& spec) {
  if (n.is_null()) return absl::OkStatus();
  const std::string type = n.value("type", "");
  if (type == "Sequence") {
    for (const json& sub : n.at("normalizers"))
      IG_RETURN_IF_ERROR(ParseNormalizer(sub, path, spec));
    return absl::OkStatus();
  }
  if (type == "Prepend") {
    if (!spec.replacements.empty()) return Unsupported(path, "Prepend after Replace");
    spec.prepend = n.value("prepend", "");
    return absl::OkStatus();
  }
  if (type == "Replace" && n.contains("pattern") && n.at("pattern").contains("String")) {
    spec.replacements.emplace_back(n.at("pattern").at("String").get<std::string>(),
                                   n.value("content", ""));
    return absl::OkStatus();
  }
  return Unsupported(path, absl::StrCat("normalizer ", n.dump()));
}

absl::Status ParsePreTokenizer(const json& p, const std::string& path, TokenizerSpec& spec) {
  if (p.is_null()) return absl::OkStatus();
  const std::string type = p.value("type", "");
  if (type == "Sequence") {
    for (const json& sub : p.at("pretokenizers"))
      IG_RETURN_IF_ERROR(ParsePreTokenizer(sub, path, spec));
    return absl::OkStatus();
  }
  if (type == "Split") {
    if (!p.contains("pattern") || !p.at("pattern").contains("Regex") ||
        p.value("behavior", "") != "Isolated" || p.value("invert", false)) {
      return Unsupported(path, absl::StrCat("pre-tokenizer ", p.dump()));
    }
    auto pattern = RecognizeSplitRegex(p.at("pattern").at("Regex").get<std::string>());
    if (!pattern.ok()) return Unsupported(path, std::string(pattern.status().message()));
    spec.split = *pattern;
    return absl::OkStatus();
  }
  if (type == "ByteLevel") {
    spec.byte_level = true;
    spec.byte_level_prefix_space = p.value("add_prefix_space", false);
    if (p.value("use_regex", true)) {
      if (spec.split != SplitPattern::kNone) return Unsupported(path, "two splitting regexes");
      spec.split = SplitPattern::kGpt2;
    }
    return absl::OkStatus();
  }
  if (type == "Digits" && p.value("individual_digits", false)) {
    spec.split_digits = true;
    return absl::OkStatus();
  }
  return Unsupported(path, absl::StrCat("pre-tokenizer ", p.dump()));
}

absl::Status ParseDecoder(const json& d, const std::string& path, TokenizerSpec& spec) {
  const std::string type = d.is_null() ? "" : d.value("type", "");
  if (type == "ByteLevel") {
    spec.decoder = TokenizerSpec::Decoder::kByteLevel;
    return absl::OkStatus();
  }
  if (type == "Sequence") {
    // The SentencePiece-style chain: Replace(▁ -> " "), ByteFallback, Fuse, Strip(" ", 1, 0).
    spec.decoder = TokenizerSpec::Decoder::kSentencePiece;
    for (const json& sub : d.at("decoders")) {
      const std::string t = sub.value("type", "");
      if (t == "Replace" && sub.contains("pattern") &&
          sub.at("pattern").value("String", "") == kSpaceSymbol &&
          sub.value("content", "") == " ") {
        continue;
      }
      if (t == "ByteFallback" || t == "Fuse") continue;
      if (t == "Strip" && sub.value("content", "") == " " && sub.value("start", 0) == 1 &&
          sub.value("stop", 0) == 0) {
        spec.decoder_strips_leading_space = true;
        continue;
      }
      return Unsupported(path, absl::StrCat("decoder step ", sub.dump()));
    }
    return absl::OkStatus();
  }
  return Unsupported(path, absl::StrCat("decoder ", d.dump()));
}

// "single" of a TemplateProcessing: special tokens before and after the sequence.
absl::Status ParsePostProcessor(const json& p, const std::string& path, TokenizerSpec& spec) {
  if (p.is_null()) return absl::OkStatus();
  const std::string type = p.value("type", "");
  if (type == "Sequence") {
    for (const json& sub : p.at("processors"))
      IG_RETURN_IF_ERROR(ParsePostProcessor(sub, path, spec));
    return absl::OkStatus();
  }
  if (type == "ByteLevel") return absl::OkStatus();  // offsets only
  if (type != "TemplateProcessing") return Unsupported(path, "post-processor " + type);
  bool after = false;
  for (const json& item : p.at("single")) {
    if (item.contains("Sequence")) {
      after = true;
      continue;
    }
    const std::string name = item.at("SpecialToken").value("id", "");
    const json& entry = p.at("special_tokens").at(name);
    for (const json& id : entry.at("ids"))
      (after ? spec.suffix_ids : spec.prefix_ids).push_back(id);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHfJson(const std::string& path,
                                                      const std::string& config_path) {
  IG_ASSIGN_OR_RETURN(json j, ReadJson(path));
  TokenizerSpec spec;
  try {
    const json& m = j.at("model");
    if (m.value("type", "BPE") != "BPE") {
      return Unsupported(path, absl::StrCat("model type ", m.value("type", "")));
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      if (m.contains(key) && m[key].is_string() && !m[key].get<std::string>().empty()) {
        return Unsupported(path, key);
      }
    }
    absl::flat_hash_map<std::string, int32_t> vocab;
    for (auto& [token, id] : m.at("vocab").items()) {
      IG_ASSIGN_OR_RETURN(const int32_t i, VocabId(id, path, token));
      vocab[token] = i;
      if (i >= static_cast<int32_t>(spec.id_to_token.size())) spec.id_to_token.resize(i + 1);
      spec.id_to_token[i] = token;
    }
    std::vector<std::pair<std::string, std::string>> merges;
    for (const json& merge : m.at("merges")) {
      if (merge.is_array() && merge.size() == 2) {
        merges.emplace_back(merge[0].get<std::string>(), merge[1].get<std::string>());
      } else {
        const std::string s = merge.get<std::string>();
        const size_t space = s.find(' ');
        if (space == std::string::npos) {
          return absl::InvalidArgumentError(absl::StrCat(path, ": merge \"", s, "\" has no space"));
        }
        merges.emplace_back(s.substr(0, space), s.substr(space + 1));
      }
    }
    BpeOptions options;
    options.byte_fallback = m.value("byte_fallback", false);
    options.ignore_merges = m.value("ignore_merges", false);
    options.fuse_unk = m.value("fuse_unk", false);
    if (m.contains("unk_token") && m["unk_token"].is_string()) {
      auto it = vocab.find(m["unk_token"].get<std::string>());
      if (it != vocab.end()) options.unk_id = it->second;
    }
    auto bpe = BpeModel::Create(vocab, merges, options);
    if (!bpe.ok())
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", bpe.status().message()));
    spec.model = std::move(*bpe);

    if (j.contains("added_tokens")) {
      for (const json& a : j["added_tokens"]) {
        AddedToken t;
        t.id = a.at("id").get<int32_t>();
        t.content = a.at("content").get<std::string>();
        t.special = a.value("special", false);
        t.lstrip = a.value("lstrip", false);
        t.rstrip = a.value("rstrip", false);
        spec.added.push_back(t);
      }
    }
    IG_RETURN_IF_ERROR(ParseNormalizer(j.value("normalizer", json()), path, spec));
    IG_RETURN_IF_ERROR(ParsePreTokenizer(j.value("pre_tokenizer", json()), path, spec));
    IG_RETURN_IF_ERROR(ParseDecoder(j.value("decoder", json()), path, spec));
    IG_RETURN_IF_ERROR(ParsePostProcessor(j.value("post_processor", json()), path, spec));
    IG_ASSIGN_OR_RETURN(TokenizerConfig config, ReadTokenizerConfig(config_path));
    if (!spec.prefix_ids.empty()) spec.bos_id = spec.prefix_ids[0];
    ApplyConfig(config, vocab, spec);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": malformed tokenizer: ", e.what()));
  }
  return Tokenizer::Create(std::move(spec));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadVocabMerges(const std::string& dir) {
  const std::string vocab_path = (fs::path(dir) / "vocab.json").string();
  const std::string merges_path = (fs::path(dir) / "merges.txt").string();
  IG_ASSIGN_OR_RETURN(json v, ReadJson(vocab_path));
  IG_ASSIGN_OR_RETURN(std::string merges_text, ReadFile(merges_path));
  TokenizerSpec spec;
  absl::flat_hash_map<std::string, int32_t> vocab;
  if (!v.is_object()) return absl::InvalidArgumentError(vocab_path + ": not a JSON object");
  for (auto& [token, id] : v.items()) {
    IG_ASSIGN_OR_RETURN(const int32_t i, VocabId(id, vocab_path, token));
    vocab[token] = i;
    if (i >= static_cast<int32_t>(spec.id_to_token.size())) spec.id_to_token.resize(i + 1);
    spec.id_to_token[i] = token;
  }
  std::vector<std::pair<std::string, std::string>> merges;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(merges_text, '\n')) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_no == 1 && absl::StartsWith(line, "#version"))) continue;
    const size_t space = line.find(' ');
    if (space == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(merges_path, ":", line_no, ": expected two tokens separated by a space"));
    }
    merges.emplace_back(std::string(line.substr(0, space)), std::string(line.substr(space + 1)));
  }
  auto bpe = BpeModel::Create(vocab, merges, BpeOptions{});
  if (!bpe.ok())
    return absl::InvalidArgumentError(absl::StrCat(merges_path, ": ", bpe.status().message()));
  spec.model = std::move(*bpe);
  spec.byte_level = true;
  spec.split = SplitPattern::kGpt2;
  spec.decoder = TokenizerSpec::Decoder::kByteLevel;
  IG_ASSIGN_OR_RETURN(TokenizerConfig config,
                      ReadTokenizerConfig((fs::path(dir) / "tokenizer_config.json").string()));
  spec.added = config.added;
  ApplyConfig(config, vocab, spec);
  return Tokenizer::Create(std::move(spec));
}

// Shared by tokenizer.model and GGUF "llama" vocabularies.
absl::StatusOr<TokenizerSpec> SpecFromSentencePiece(const SentencePieceSpec& sp,
                                                    const std::string& path, bool match_control) {
  if (!sp.bpe) return Unsupported(path, "a SentencePiece unigram model");
  if (sp.has_precompiled_charsmap ||
      (!sp.normalizer_name.empty() && sp.normalizer_name != "identity")) {
    return Unsupported(path, absl::StrCat("SentencePiece normalizer \"", sp.normalizer_name, "\""));
  }
  TokenizerSpec spec;
  spec.collapse_spaces = sp.remove_extra_whitespaces;
  if (sp.add_dummy_prefix) spec.prepend = sp.escape_whitespaces ? kSpaceSymbol : " ";
  if (sp.escape_whitespaces) spec.replacements.emplace_back(" ", kSpaceSymbol);
  spec.model = SentencePieceBpe(sp);
  spec.decoder = TokenizerSpec::Decoder::kSentencePiece;
  spec.decoder_strips_leading_space = sp.add_dummy_prefix;
  for (size_t i = 0; i < sp.pieces.size(); ++i) {
    spec.id_to_token.push_back(sp.pieces[i].text);
    if (sp.pieces[i].type == PieceType::kControl) {
      AddedToken a;
      a.id = static_cast<int32_t>(i);
      a.content = sp.pieces[i].text;
      a.match_in_text = match_control;
      spec.added.push_back(a);
    }
  }
  const int32_t n = static_cast<int32_t>(sp.pieces.size());
  spec.bos_id = sp.bos_id < n ? sp.bos_id : -1;
  if (sp.eos_id >= 0 && sp.eos_id < n) spec.eos_ids = {sp.eos_id};
  if (spec.bos_id >= 0) spec.prefix_ids = {spec.bos_id};
  return spec;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadSentencePiece(const std::string& path) {
  IG_ASSIGN_OR_RETURN(std::string bytes, ReadFile(path));
  auto sp = ParseSentencePieceModel(bytes);
  if (!sp.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", sp.status().message()));
  // Like the sentencepiece library, control pieces (<s>, </s>) are not recognized in text.
  IG_ASSIGN_OR_RETURN(TokenizerSpec spec,
                      SpecFromSentencePiece(*sp, path, /*match_control=*/false));
  return Tokenizer::Create(std::move(spec));
}

// A metadata array's strings (none when the key is missing), without copying them.
const std::vector<std::string>& StringArray(const GgufValue* v) {
  static const std::vector<std::string> kNone;
  return v == nullptr ? kNone : v->strings;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const GgufFile& g,
                                                               const std::string& path) {
  const std::string kind = g.StringOr("tokenizer.ggml.model", "");
  const std::vector<std::string>& tokens = StringArray(g.Find("tokenizer.ggml.tokens"));
  const GgufValue* types = g.Find("tokenizer.ggml.token_type");
  if (tokens.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no tokenizer.ggml.tokens"));
  }
  if (types != nullptr && types->ints.size() != tokens.size()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": tokenizer.ggml.token_type has ",
                                                   types->ints.size(), " integer entries for ",
                                                   tokens.size(), " tokens"));
  }
  auto type_of = [&](size_t i) {
    return types != nullptr ? static_cast<int32_t>(types->ints[i]) : 1;
  };
  TokenizerSpec spec;
  if (kind == "gpt2") {
    absl::flat_hash_map<std::string, int32_t> vocab;
    for (size_t i = 0; i < tokens.size(); ++i)
      vocab.try_emplace(tokens[i], static_cast<int32_t>(i));
    std::vector<std::pair<std::string, std::string>> merges;
    for (const std::string& m : StringArray(g.Find("tokenizer.ggml.merges"))) {
      const size_t space = m.find(' ');
      if (space == std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": merge \"", m, "\" has no space"));
      }
      merges.emplace_back(m.substr(0, space), m.substr(space + 1));
    }
    const std::string pre = g.StringOr("tokenizer.ggml.pre", "default");
    BpeOptions options;
    if (pre == "default" || pre == "gpt-2" || pre == "gpt2") {
      spec.split = SplitPattern::kGpt2;
    } else if (pre == "smollm") {
      spec.split_digits = true;
      spec.split = SplitPattern::kGpt2;
    } else if (pre == "llama-bpe" || pre == "llama3" || pre == "llama-v3") {
      spec.split = SplitPattern::kLlama3;
      options.ignore_merges = true;
    } else {
      return Unsupported(path, absl::StrCat("GGUF pre-tokenizer \"", pre, "\""));
    }
    auto bpe = BpeModel::Create(std::move(vocab), merges, options);
    if (!bpe.ok())
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", bpe.status().message()));
    spec.model = std::move(*bpe);
    spec.byte_level = true;
    spec.decoder = TokenizerSpec::Decoder::kByteLevel;
    spec.id_to_token = tokens;
    constexpr int32_t kControl = 3, kUserDefined = 4;
    for (size_t i = 0; i < tokens.size(); ++i) {
      const int32_t t = type_of(i);
      if (t == kControl || t == kUserDefined) {
        AddedToken a;
        a.id = static_cast<int32_t>(i);
        a.content = tokens[i];
        a.special = t == kControl;
        spec.added.push_back(a);
      }
    }
  } else if (kind == "llama") {
    SentencePieceSpec sp;
    const GgufValue* scores = g.Find("tokenizer.ggml.scores");
    for (size_t i = 0; i < tokens.size(); ++i) {
      SentencePieceSpec::Piece p;
      p.text = tokens[i];
      p.score = scores != nullptr && i < scores->floats.size()
                    ? static_cast<float>(scores->floats[i])
                    : 0.0f;
      const int32_t t = type_of(i);
      p.type = t >= 1 && t <= 6 ? static_cast<PieceType>(t) : PieceType::kNormal;
      sp.byte_fallback = sp.byte_fallback || p.type == PieceType::kByte;
      sp.pieces.push_back(std::move(p));
    }
    sp.add_dummy_prefix = g.IntOr("tokenizer.ggml.add_space_prefix", 1) != 0;
    sp.remove_extra_whitespaces = false;
    sp.unk_id = static_cast<int32_t>(g.IntOr("tokenizer.ggml.unknown_token_id", 0));
    IG_ASSIGN_OR_RETURN(spec, SpecFromSentencePiece(sp, path, /*match_control=*/true));
  } else {
    return Unsupported(path, absl::StrCat("GGUF tokenizer model \"", kind, "\""));
  }
  const int64_t bos = g.IntOr("tokenizer.ggml.bos_token_id", -1);
  const int64_t eos = g.IntOr("tokenizer.ggml.eos_token_id", -1);
  spec.bos_id = static_cast<int32_t>(bos);
  spec.eos_ids.clear();
  if (eos >= 0) spec.eos_ids.push_back(static_cast<int32_t>(eos));
  spec.prefix_ids.clear();
  if (g.IntOr("tokenizer.ggml.add_bos_token", kind == "llama") != 0 && bos >= 0) {
    spec.prefix_ids = {static_cast<int32_t>(bos)};
  }
  if (g.IntOr("tokenizer.ggml.add_eos_token", 0) != 0 && eos >= 0) {
    spec.suffix_ids = {static_cast<int32_t>(eos)};
  }
  spec.chat_template = g.StringOr("tokenizer.chat_template", "");
  return Tokenizer::Create(std::move(spec));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path dir(path);
    if (fs::exists(dir / "tokenizer.json", ec)) {
      return LoadHfJson((dir / "tokenizer.json").string(),
                        (dir / "tokenizer_config.json").string());
    }
    if (fs::exists(dir / "tokenizer.model", ec))
      return LoadSentencePiece((dir / "tokenizer.model").string());
    if (fs::exists(dir / "vocab.json", ec) && fs::exists(dir / "merges.txt", ec)) {
      return LoadVocabMerges(path);
    }
    return absl::NotFoundError(absl::StrCat(
        path, ": no tokenizer.json, tokenizer.model, or vocab.json + merges.txt in this folder"));
  }
  if (!fs::is_regular_file(path, ec)) {
    return absl::NotFoundError(absl::StrCat(path, ": no such tokenizer file or folder"));
  }
  if (absl::EndsWith(path, ".json")) {
    return LoadHfJson(path, (fs::path(path).parent_path() / "tokenizer_config.json").string());
  }
  if (absl::EndsWith(path, ".model")) return LoadSentencePiece(path);
  IG_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path));
  IG_ASSIGN_OR_RETURN(GgufFile gguf, GgufFile::Parse(file));
  return FromGguf(gguf, path);
}

}  // namespace infinigen
