#include "gpu_worker/tokenizer/sentencepiece.h"

#include <algorithm>
#include <cstring>
#include <queue>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gpu_worker/tokenizer/unicode.h"

namespace infinigen {
namespace {

// Protobuf wire format reader over a byte range, bounds-checked.
class WireReader {
 public:
  explicit WireReader(absl::string_view data) : data_(data) {}
  bool done() const { return pos_ >= data_.size(); }
  bool ok() const { return ok_; }

  bool Varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= data_.size()) return ok_ = false;
      const uint8_t b = static_cast<uint8_t>(data_[pos_++]);
      *v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return ok_ = false;
  }
  bool Tag(uint32_t* field, uint32_t* wire) {
    uint64_t t;
    if (!Varint(&t)) return false;
    *field = static_cast<uint32_t>(t >> 3);
    *wire = static_cast<uint32_t>(t & 7);
    return true;
  }
  bool Bytes(absl::string_view* out) {
    uint64_t n;
    if (!Varint(&n) || n > data_.size() - pos_) return ok_ = false;
    *out = data_.substr(pos_, n);
    pos_ += n;
    return true;
  }
  bool Fixed32(uint32_t* v) {
    if (data_.size() - pos_ < 4) return ok_ = false;
    std::memcpy(v, data_.data() + pos_, 4);
    pos_ += 4;
    return true;
  }
  bool Skip(uint32_t wire) {
    uint64_t v;
    absl::string_view s;
    uint32_t f;
    switch (wire) {
      case 0:
        return Varint(&v);
      case 1:
        if (data_.size() - pos_ < 8) return ok_ = false;
        pos_ += 8;
        return true;
      case 2:
        return Bytes(&s);
      case 5:
        return Fixed32(&f);
      default:
        return ok_ = false;
    }
  }

 private:
  absl::string_view data_;
  size_t pos_ = 0;
  bool ok_ = true;
};

absl::Status Malformed(const char* what) {
  return absl::InvalidArgumentError(
      absl::StrCat("not a valid SentencePiece model: malformed ", what));
}

absl::Status ParsePiece(absl::string_view bytes, SentencePieceSpec::Piece& piece) {
  WireReader r(bytes);
  while (!r.done()) {
    uint32_t field, wire;
    if (!r.Tag(&field, &wire)) return Malformed("piece");
    if (field == 1 && wire == 2) {
      absl::string_view s;
      if (!r.Bytes(&s)) return Malformed("piece text");
      piece.text = std::string(s);
    } else if (field == 2 && wire == 5) {
      uint32_t bits;
      if (!r.Fixed32(&bits)) return Malformed("piece score");
      std::memcpy(&piece.score, &bits, 4);
    } else if (field == 3 && wire == 0) {
      uint64_t t;
      if (!r.Varint(&t) || t < 1 || t > 6) return Malformed("piece type");
      piece.type = static_cast<PieceType>(t);
    } else if (!r.Skip(wire)) {
      return Malformed("piece field");
    }
  }
  return absl::OkStatus();
}

absl::Status ParseTrainerSpec(absl::string_view bytes, SentencePieceSpec& spec) {
  WireReader r(bytes);
  while (!r.done()) {
    uint32_t field, wire;
    if (!r.Tag(&field, &wire)) return Malformed("trainer_spec");
    uint64_t v;
    if (wire == 0 && (field == 3 || field == 35 || field == 40 || field == 41 || field == 42)) {
      if (!r.Varint(&v)) return Malformed("trainer_spec field");
      if (field == 3) spec.bpe = v == 2;
      if (field == 35) spec.byte_fallback = v != 0;
      if (field == 40) spec.unk_id = static_cast<int32_t>(v);
      if (field == 41) spec.bos_id = static_cast<int32_t>(v);
      if (field == 42) spec.eos_id = static_cast<int32_t>(v);
    } else if (!r.Skip(wire)) {
      return Malformed("trainer_spec field");
    }
  }
  return absl::OkStatus();
}

absl::Status ParseNormalizerSpec(absl::string_view bytes, SentencePieceSpec& spec) {
  WireReader r(bytes);
  while (!r.done()) {
    uint32_t field, wire;
    if (!r.Tag(&field, &wire)) return Malformed("normalizer_spec");
    uint64_t v;
    absl::string_view s;
    if (field == 1 && wire == 2) {
      if (!r.Bytes(&s)) return Malformed("normalizer name");
      spec.normalizer_name = std::string(s);
    } else if (field == 2 && wire == 2) {
      if (!r.Bytes(&s)) return Malformed("precompiled_charsmap");
      spec.has_precompiled_charsmap = !s.empty();
    } else if ((field == 3 || field == 4 || field == 5) && wire == 0) {
      if (!r.Varint(&v)) return Malformed("normalizer flag");
      if (field == 3) spec.add_dummy_prefix = v != 0;
      if (field == 4) spec.remove_extra_whitespaces = v != 0;
      if (field == 5) spec.escape_whitespaces = v != 0;
    } else if (!r.Skip(wire)) {
      return Malformed("normalizer_spec field");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SentencePieceSpec> ParseSentencePieceModel(absl::string_view bytes) {
  SentencePieceSpec spec;
  WireReader r(bytes);
  while (!r.done()) {
    uint32_t field, wire;
    if (!r.Tag(&field, &wire)) return Malformed("ModelProto");
    absl::string_view sub;
    if (wire == 2 && (field == 1 || field == 2 || field == 3)) {
      if (!r.Bytes(&sub)) return Malformed("ModelProto field");
      absl::Status st;
      if (field == 1) st = ParsePiece(sub, spec.pieces.emplace_back());
      if (field == 2) st = ParseTrainerSpec(sub, spec);
      if (field == 3) st = ParseNormalizerSpec(sub, spec);
      if (!st.ok()) return st;
    } else if (!r.Skip(wire)) {
      return Malformed("ModelProto field");
    }
  }
  if (spec.pieces.empty()) return Malformed("piece list (it is empty)");
  return spec;
}

SentencePieceBpe::SentencePieceBpe(const SentencePieceSpec& spec)
    : byte_fallback_(spec.byte_fallback), unk_id_(spec.unk_id) {
  std::fill(std::begin(byte_ids_), std::end(byte_ids_), -1);
  for (size_t i = 0; i < spec.pieces.size(); ++i) {
    const auto& p = spec.pieces[i];
    const int32_t id = static_cast<int32_t>(i);
    all_.try_emplace(p.text, id);
    scores_.push_back(p.score);
    if (p.type == PieceType::kNormal || p.type == PieceType::kUserDefined) {
      mergeable_.try_emplace(p.text, id);
    }
    if (p.type == PieceType::kUserDefined) user_defined_.push_back(p.text);
    if (p.type == PieceType::kByte && p.text.size() == 6) {
      unsigned int b;
      if (std::sscanf(p.text.c_str(), "<0x%02X>", &b) == 1 && b < 256) byte_ids_[b] = id;
    }
  }
  std::sort(user_defined_.begin(), user_defined_.end(),
            [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
}

void SentencePieceBpe::Encode(absl::string_view text, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  struct Symbol {
    int32_t prev, next;
    size_t begin, len;  // bytes of text; len 0 once merged away
  };
  std::vector<Symbol> syms;
  for (size_t i = 0; i < text.size();) {
    size_t len = 0;
    for (const auto& u : user_defined_) {
      if (text.substr(i, u.size()) == u) {
        len = u.size();
        break;
      }
    }
    if (len == 0)
      len = std::min(unicode::Utf8SequenceLength(static_cast<unsigned char>(text[i])),
                     text.size() - i);
    const int32_t idx = static_cast<int32_t>(syms.size());
    syms.push_back({idx - 1, idx + 1, i, len});
    i += len;
  }
  syms.back().next = -1;

  // Highest score first; on ties the leftmost pair.
  struct Candidate {
    float score;
    int32_t left, right;
    size_t len;  // byte length of the merged piece, to detect stale entries
    bool operator<(const Candidate& o) const {
      return score != o.score ? score < o.score : left > o.left;
    }
  };
  std::priority_queue<Candidate> queue;
  auto consider = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const size_t len = syms[left].len + syms[right].len;
    auto it = mergeable_.find(text.substr(syms[left].begin, len));
    if (it != mergeable_.end()) queue.push({scores_[it->second], left, right, len});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(syms.size()); ++i) consider(i, i + 1);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& l = syms[c.left];
    Symbol& r = syms[c.right];
    if (l.len == 0 || r.len == 0 || l.next != c.right || l.len + r.len != c.len) continue;
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) syms[r.next].prev = c.left;
    consider(l.prev, c.left);
    consider(c.left, l.next);
  }
  for (int32_t i = 0; i >= 0; i = syms[i].next) {
    const absl::string_view piece = text.substr(syms[i].begin, syms[i].len);
    auto it = all_.find(piece);
    if (it != all_.end()) {
      out.push_back(it->second);
      continue;
    }
    bool bytes_ok = byte_fallback_;
    for (unsigned char b : piece) bytes_ok = bytes_ok && byte_ids_[b] >= 0;
    if (bytes_ok) {
      for (unsigned char b : piece) out.push_back(byte_ids_[b]);
    } else {
      out.push_back(unk_id_);
    }
  }
}

}  // namespace infinigen
