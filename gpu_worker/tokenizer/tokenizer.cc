#include "gpu_worker/tokenizer/tokenizer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gpu_worker/tokenizer/unicode.h"

namespace infinigen {
namespace {

constexpr absl::string_view kSpaceSymbol = "\xE2\x96\x81";  // U+2581, SentencePiece's space

bool IsAsciiSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// "<0xXX>" -> XX, else -1.
int ByteToken(absl::string_view t) {
  if (t.size() != 6 || t[0] != '<' || t[1] != '0' || t[2] != 'x' || t[5] != '>') return -1;
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  const int hi = hex(t[3]), lo = hex(t[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

}  // namespace

Tokenizer::Tokenizer(TokenizerSpec spec) : spec_(std::move(spec)) {}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Create(TokenizerSpec spec) {
  if (std::holds_alternative<std::monostate>(spec.model)) {
    return absl::InvalidArgumentError("tokenizer has no subword model");
  }
  for (const AddedToken& a : spec.added) {
    if (a.id < 0 || a.content.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("added token '", a.content, "' has an invalid id ", a.id));
    }
    if (a.id >= static_cast<int32_t>(spec.id_to_token.size())) spec.id_to_token.resize(a.id + 1);
    spec.id_to_token[a.id] = a.content;
  }
  const int32_t n = static_cast<int32_t>(spec.id_to_token.size());
  auto check = [&](int32_t id, const char* what) -> absl::Status {
    if (id >= -1 && id < n) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(what, " id ", id, " is outside the vocabulary of ", n));
  };
  if (auto st = check(spec.bos_id, "BOS"); !st.ok()) return st;
  for (int32_t id : spec.eos_ids) {
    if (auto st = check(id, "EOS"); !st.ok()) return st;
  }
  for (int32_t id : spec.prefix_ids) {
    if (auto st = check(id, "post-processor"); !st.ok()) return st;
  }
  for (int32_t id : spec.suffix_ids) {
    if (auto st = check(id, "post-processor"); !st.ok()) return st;
  }
  std::unique_ptr<Tokenizer> t(new Tokenizer(std::move(spec)));
  const TokenizerSpec& s = t->spec_;
  t->token_to_id_.reserve(s.id_to_token.size());
  for (int32_t id = 0; id < n; ++id) t->token_to_id_.try_emplace(s.id_to_token[id], id);
  t->flags_.assign(n, 0);
  t->added_by_first_byte_.resize(256);
  for (size_t i = 0; i < s.added.size(); ++i) {
    const AddedToken& a = s.added[i];
    t->token_to_id_[a.content] = a.id;
    t->flags_[a.id] = kAdded | (a.special ? kSpecial : 0);
    if (a.match_in_text) {
      t->added_by_first_byte_[static_cast<unsigned char>(a.content[0])].push_back(
          static_cast<int32_t>(i));
    }
  }
  if (s.decoder == TokenizerSpec::Decoder::kSentencePiece && s.split == SplitPattern::kNone) {
    t->split_at_space_symbol_ =
        std::none_of(s.id_to_token.begin(), s.id_to_token.end(), [](const std::string& tok) {
          const absl::string_view t = tok, sym = kSpaceSymbol;
          for (size_t p = t.find(sym, 1); p != absl::string_view::npos; p = t.find(sym, p + 1)) {
            if (p < sym.size() || t.substr(p - sym.size(), sym.size()) != sym) {
              return true;  // "x▁": a merge could cross a word start
            }
          }
          return false;
        });
  }
  for (auto& bucket : t->added_by_first_byte_) {
    std::sort(bucket.begin(), bucket.end(), [&](int32_t a, int32_t b) {
      return s.added[a].content.size() > s.added[b].content.size();
    });
  }
  return t;
}

bool Tokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && id < static_cast<int32_t>(flags_.size()) && (flags_[id] & kSpecial);
}

const std::string& Tokenizer::TokenText(int32_t id) const {
  static const std::string kEmpty;
  return id >= 0 && id < vocab_size() ? spec_.id_to_token[id] : kEmpty;
}

int32_t Tokenizer::TokenId(absl::string_view text) const {
  auto it = token_to_id_.find(text);
  return it == token_to_id_.end() ? -1 : it->second;
}

void Tokenizer::EncodeSegment(absl::string_view segment, std::vector<int32_t>& out) const {
  std::string collapsed;
  if (spec_.collapse_spaces) {
    for (char c : segment) {
      if (c == ' ' && (collapsed.empty() || collapsed.back() == ' ')) continue;
      collapsed.push_back(c);
    }
    if (!collapsed.empty() && collapsed.back() == ' ') collapsed.pop_back();
    segment = collapsed;
  }
  if (segment.empty()) return;
  std::string text;
  if (!spec_.prepend.empty()) text = spec_.prepend;
  text.append(segment.data(), segment.size());
  for (const auto& [from, to] : spec_.replacements) text = absl::StrReplaceAll(text, {{from, to}});

  const std::vector<uint32_t> cps = unicode::DecodeUtf8(text);
  std::vector<std::pair<size_t, size_t>> coarse, pieces;
  if (spec_.split_digits) {
    SplitDigits(cps.data(), cps.size(), coarse);
  } else {
    coarse.emplace_back(0, cps.size());
  }
  for (const auto& [b, e] : coarse) {
    std::vector<std::pair<size_t, size_t>> sub;
    SplitByPattern(spec_.split, cps.data() + b, e - b, sub);
    for (const auto& [sb, se] : sub) pieces.emplace_back(b + sb, b + se);
  }
  if (split_at_space_symbol_) {
    constexpr uint32_t kSpaceCp = 0x2581;
    std::vector<std::pair<size_t, size_t>> words;
    for (const auto& [b, e] : pieces) {
      size_t start = b;
      for (size_t i = b + 1; i < e; ++i) {
        if (cps[i] == kSpaceCp && cps[i - 1] != kSpaceCp) {
          words.emplace_back(start, i);
          start = i;
        }
      }
      words.emplace_back(start, e);
    }
    pieces.swap(words);
  }
  std::string piece, mapped;
  for (size_t k = 0; k < pieces.size(); ++k) {
    const auto& [b, e] = pieces[k];
    piece = unicode::EncodeUtf8(cps.data() + b, e - b);
    absl::string_view word = piece;
    if (spec_.byte_level) {
      mapped.clear();
      if (k == 0 && spec_.byte_level_prefix_space && piece[0] != ' ') {
        ByteLevelMap::Get().Encode(" ", mapped);
      }
      ByteLevelMap::Get().Encode(piece, mapped);
      word = mapped;
    }
    if (const auto* bpe = std::get_if<BpeModel>(&spec_.model)) {
      bpe->Encode(word, out);
    } else if (const auto* spm = std::get_if<SentencePieceBpe>(&spec_.model)) {
      spm->Encode(word, out);
    }
  }
}

std::vector<int32_t> Tokenizer::Encode(absl::string_view raw, bool add_special) const {
  const std::string text = unicode::SanitizeUtf8(raw);
  std::vector<int32_t> out;
  if (add_special) out = spec_.prefix_ids;
  size_t segment_start = 0, i = 0;
  while (i < text.size()) {
    const AddedToken* match = nullptr;
    for (int32_t idx : added_by_first_byte_[static_cast<unsigned char>(text[i])]) {
      const AddedToken& a = spec_.added[idx];
      if (text.compare(i, a.content.size(), a.content) == 0) {
        match = &a;
        break;
      }
    }
    if (match == nullptr) {
      ++i;
      continue;
    }
    size_t seg_end = i, next = i + match->content.size();
    if (match->lstrip) {
      while (seg_end > segment_start && IsAsciiSpace(text[seg_end - 1])) --seg_end;
    }
    if (match->rstrip) {
      while (next < text.size() && IsAsciiSpace(text[next])) ++next;
    }
    EncodeSegment(absl::string_view(text).substr(segment_start, seg_end - segment_start), out);
    out.push_back(match->id);
    segment_start = i = next;
  }
  EncodeSegment(absl::string_view(text).substr(segment_start), out);
  if (add_special) out.insert(out.end(), spec_.suffix_ids.begin(), spec_.suffix_ids.end());
  return out;
}

void Tokenizer::AppendTokenBytes(int32_t id, bool first, std::string& out) const {
  if (id < 0 || id >= vocab_size()) return;
  const std::string& t = spec_.id_to_token[id];
  if (flags_[id] & kAdded) {  // added tokens decode to their text as written
    out += t;
    return;
  }
  if (spec_.decoder == TokenizerSpec::Decoder::kByteLevel) {
    const size_t start = out.size();
    for (uint32_t cp : unicode::DecodeUtf8(t)) {
      const int b = ByteLevelMap::Get().Decode(cp);
      if (b < 0) {  // not a byte-level token: its own bytes, as Hugging Face does
        out.resize(start);
        out += t;
        return;
      }
      out.push_back(static_cast<char>(b));
    }
    return;
  }
  if (const int b = ByteToken(t); b >= 0) {
    out.push_back(static_cast<char>(b));
    return;
  }
  std::string s = absl::StrReplaceAll(t, {{kSpaceSymbol, " "}});
  if (first && spec_.decoder_strips_leading_space && !s.empty() && s[0] == ' ') s.erase(0, 1);
  out += s;
}

std::string Tokenizer::Decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string bytes;
  bool first = true;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size() || (skip_special && IsSpecial(id))) continue;
    AppendTokenBytes(id, first, bytes);
    first = false;
  }
  return unicode::SanitizeUtf8(bytes);
}

IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special)
    : tokenizer_(tokenizer), skip_special_(skip_special) {}

std::string IncrementalDecoder::Add(int32_t id) {
  if (id < 0 || id >= tokenizer_.vocab_size() || (skip_special_ && tokenizer_.IsSpecial(id))) {
    return "";
  }
  tokenizer_.AppendTokenBytes(id, first_, pending_);
  first_ = false;
  const size_t n = unicode::CompleteUtf8Prefix(pending_);
  std::string out = unicode::SanitizeUtf8(absl::string_view(pending_).substr(0, n));
  pending_.erase(0, n);
  return out;
}

std::string IncrementalDecoder::Finish() {
  std::string out = unicode::SanitizeUtf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace infinigen
