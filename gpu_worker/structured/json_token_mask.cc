#include "gpu_worker/structured/json_token_mask.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "gpu_worker/tokenizer/tokenizer.h"

namespace infinigen {

std::shared_ptr<const JsonVocabulary> JsonVocabulary::FromTokenizer(const Tokenizer& tokenizer) {
  auto v = std::make_shared<JsonVocabulary>();
  const int32_t n = tokenizer.vocab_size();
  v->bytes.resize(static_cast<size_t>(n));
  v->usable.assign(static_cast<size_t>(n), 0);
  for (int32_t id = 0; id < n; ++id) {
    if (tokenizer.IsSpecial(id)) continue;
    tokenizer.AppendTokenBytes(id, /*first=*/false, v->bytes[id]);
    v->usable[id] = v->bytes[id].empty() ? 0 : 1;
  }
  v->Classify();
  return v;
}

void JsonVocabulary::Classify() {
  plain.assign(bytes.size(), 0);
  for (size_t id = 0; id < bytes.size(); ++id) {
    if (usable[id] == 0) continue;
    JsonPrefix in_string(/*object_only=*/false);
    in_string.Feed('"');
    bool ok = true;
    for (char c : bytes[id]) {
      if (c == '"' || c == '\\' || !in_string.Feed(static_cast<uint8_t>(c))) {
        ok = false;
        break;
      }
    }
    plain[id] = ok && in_string.InStringBody() ? 1 : 0;
  }
  head.assign(bytes.size(), 0);
  for (size_t id = 0; id < bytes.size(); ++id) {
    const std::string& b = bytes[id];
    uint32_t h = 0;
    if (!b.empty()) h |= static_cast<uint8_t>(b[0]);
    if (b.size() >= 2) h |= static_cast<uint32_t>(static_cast<uint8_t>(b[1])) << 8 | kTwo;
    if (b.size() > 2) h |= kLonger;
    if (usable[id] != 0) h |= kUsable;
    if (plain[id] != 0) h |= kPlain;
    head[id] = h;
  }
}

bool JsonTokenMask::Mask(std::span<float> row, std::span<const int32_t> stops) {
  const JsonVocabulary& v = *vocabulary_;
  stop_logits_.clear();
  for (int32_t stop : stops) {
    stop_logits_.push_back(stop >= 0 && static_cast<size_t>(stop) < row.size() ? row[stop]
                                                                               : -INFINITY);
  }
  // Which first bytes may come, and outside strings which pairs: a token that starts
  // otherwise is out without reading it (after a value, most of a vocabulary starts with a
  // space and a letter). Inside a string the plain tokens may all come.
  const bool in_string = state_.InStringBody();
  std::array<uint8_t, 256> first;
  std::array<std::array<uint64_t, 4>, 256> pair;  // bit c of pair[b]: "bc" may come
  for (int b = 0; b < 256; ++b) {
    JsonPrefix next = state_;
    first[b] = next.Feed(static_cast<uint8_t>(b)) ? 1 : 0;
    pair[b].fill(0);
    if (first[b] == 0 || in_string) continue;
    for (int c = 0; c < 256; ++c) {
      JsonPrefix after = next;
      if (after.Feed(static_cast<uint8_t>(c))) pair[b][c >> 6] |= uint64_t{1} << (c & 63);
    }
  }
  // Branch-free but for the few tokens that must be read whole.
  float* out = row.data();
  const uint32_t* heads = v.head.data();
  const size_t known = std::min(row.size(), v.bytes.size());
  for (size_t id = 0; id < known; ++id) {
    const uint32_t h = heads[id];
    const uint32_t b0 = h & 0xff, b1 = (h >> 8) & 0xff;
    const bool two = (h & JsonVocabulary::kTwo) != 0;
    bool ok = ((h & JsonVocabulary::kUsable) != 0) & (first[b0] != 0);
    bool read;
    if (in_string) {
      read = ok & two & ((h & JsonVocabulary::kPlain) == 0);
    } else {
      ok = ok & (!two | (((pair[b0][b1 >> 6] >> (b1 & 63)) & 1) != 0));
      read = ok & ((h & JsonVocabulary::kLonger) != 0);
    }
    if (read) [[unlikely]] {
      ok = JsonPrefix(state_).Feed(v.bytes[id]);
    }
    out[id] = ok ? out[id] : -INFINITY;
  }
  for (size_t id = known; id < row.size(); ++id) row[id] = -INFINITY;  // no bytes: no text
  // A stop token ends the sequence: once the object is whole any may come; before, one whose
  // bytes continue the text may (a user's stop_token_ids naming "}", say), as the pass above
  // decided, and an end-of-sequence token (special: no bytes) may not.
  if (state_.Complete()) {
    for (size_t i = 0; i < stops.size(); ++i) {
      if (stops[i] >= 0 && static_cast<size_t>(stops[i]) < row.size()) {
        row[stops[i]] = stop_logits_[i];
      }
    }
  }
  return std::any_of(row.begin(), row.end(), [](float x) { return x != -INFINITY; });
}

bool JsonTokenMask::Accept(int32_t token) {
  const JsonVocabulary& v = *vocabulary_;
  if (token < 0 || static_cast<size_t>(token) >= v.bytes.size() || v.usable[token] == 0) {
    return false;
  }
  return state_.Feed(v.bytes[token]);
}

}  // namespace infinigen
