#include "gpu_worker/tokenizer/bpe.h"

#include <queue>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gpu_worker/tokenizer/unicode.h"

namespace infinigen {

absl::StatusOr<BpeModel> BpeModel::Create(
    absl::flat_hash_map<std::string, int32_t> vocab,
    const std::vector<std::pair<std::string, std::string>>& merges, const BpeOptions& options) {
  BpeModel m;
  m.vocab_ = std::move(vocab);
  m.options_ = options;
  for (int b = 0; b < 256; ++b) {
    auto it = m.vocab_.find(absl::StrFormat("<0x%02X>", b));
    m.byte_ids_[b] = it == m.vocab_.end() ? -1 : it->second;
  }
  m.merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    auto ia = m.vocab_.find(a), ib = m.vocab_.find(b), ic = m.vocab_.find(a + b);
    if (ia == m.vocab_.end() || ib == m.vocab_.end() || ic == m.vocab_.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "merge ", rank, " (\"", a, "\" + \"", b, "\") uses a token missing from the vocabulary"));
    }
    // A pair listed twice keeps its first (lowest) rank, as Hugging Face does.
    m.merges_.try_emplace(PairKey(ia->second, ib->second),
                          Merge{static_cast<int32_t>(rank), ic->second});
  }
  return m;
}

void BpeModel::Encode(absl::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (options_.ignore_merges) {
    if (auto it = vocab_.find(word); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  // Symbols as a doubly linked list over a vector.
  struct Symbol {
    int32_t id;
    int32_t prev, next;
    bool alive;
  };
  std::vector<Symbol> syms;
  syms.reserve(word.size());
  auto push = [&](int32_t id) {
    const int32_t idx = static_cast<int32_t>(syms.size());
    syms.push_back({id, idx - 1, idx + 1, true});
  };
  bool last_unk = false;
  for (size_t i = 0; i < word.size();) {
    const size_t len =
        std::min(unicode::Utf8SequenceLength(static_cast<unsigned char>(word[i])), word.size() - i);
    absl::string_view ch = word.substr(i, len);
    i += len;
    if (auto it = vocab_.find(ch); it != vocab_.end()) {
      push(it->second);
      last_unk = false;
      continue;
    }
    bool all_bytes = options_.byte_fallback;
    if (all_bytes) {
      for (unsigned char b : ch) all_bytes = all_bytes && byte_ids_[b] >= 0;
    }
    if (all_bytes) {
      for (unsigned char b : ch) push(byte_ids_[b]);
      last_unk = false;
    } else if (options_.unk_id >= 0) {
      if (!(options_.fuse_unk && last_unk)) push(options_.unk_id);
      last_unk = true;
    }
  }
  if (syms.empty()) return;
  syms.back().next = -1;

  // Candidate merges: lowest rank first, then leftmost.
  struct Candidate {
    int32_t rank, pos, id;
    bool operator<(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate> queue;
  auto consider = [&](int32_t left) {
    if (left < 0 || syms[left].next < 0) return;
    auto it = merges_.find(PairKey(syms[left].id, syms[syms[left].next].id));
    if (it != merges_.end()) queue.push({it->second.rank, left, it->second.id});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(syms.size()); ++i) consider(i);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& left = syms[c.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = syms[left.next];
    // Stale entries: the pair changed since it was queued.
    auto it = merges_.find(PairKey(left.id, right.id));
    if (it == merges_.end() || it->second.rank != c.rank || it->second.id != c.id) continue;
    left.id = c.id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) syms[right.next].prev = c.pos;
    consider(left.prev);
    consider(c.pos);
  }
  for (int32_t i = 0; i >= 0; i = syms[i].next) out.push_back(syms[i].id);
}

}  // namespace infinigen
