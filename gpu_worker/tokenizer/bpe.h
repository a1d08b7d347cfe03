// Byte-pair encoding as Hugging Face tokenizers runs it: a word starts as its characters (each
// a vocabulary entry, else byte-fallback tokens or the unknown token), then the adjacent pair
// with the lowest merge rank is merged until no ranked pair is left.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace infinigen {

struct BpeOptions {
  bool byte_fallback = false;  // characters not in the vocabulary become <0xXX> byte tokens
  bool ignore_merges = false;  // a word that is itself in the vocabulary is one token
  bool fuse_unk = false;       // consecutive unknown tokens become one
  int32_t unk_id = -1;         // -1: characters that cannot be encoded are dropped
};

class BpeModel {
 public:
  // `vocab`: token string -> id. `merges`: pairs in rank order; each merged string must be in
  // the vocabulary. Errors name the offending merge.
  static absl::StatusOr<BpeModel> Create(
      absl::flat_hash_map<std::string, int32_t> vocab,
      const std::vector<std::pair<std::string, std::string>>& merges, const BpeOptions& options);

  // Appends the ids of `word` (UTF-8, already in the model's alphabet) to `out`.
  void Encode(absl::string_view word, std::vector<int32_t>& out) const;

  const absl::flat_hash_map<std::string, int32_t>& vocab() const { return vocab_; }

 private:
  struct Merge {
    int32_t rank;
    int32_t id;
  };
  static uint64_t PairKey(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  absl::flat_hash_map<std::string, int32_t> vocab_;
  absl::flat_hash_map<uint64_t, Merge> merges_;
  BpeOptions options_;
  int32_t byte_ids_[256];  // id of "<0xXX>", or -1
};

}  // namespace infinigen
