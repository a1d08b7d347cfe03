// SentencePiece: the tokenizer.model file (a protobuf ModelProto, read here without protobuf)
// and its BPE segmentation, where the adjacent pair whose merged piece has the highest score
// merges first. Llama 2 checkpoints ship one; GGUF "llama" tokenizers carry the same pieces.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace infinigen {

enum class PieceType : int32_t {
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

struct SentencePieceSpec {
  struct Piece {
    std::string text;
    float score = 0.0f;
    PieceType type = PieceType::kNormal;
  };
  std::vector<Piece> pieces;
  bool bpe = true;  // trainer_spec.model_type == BPE (unigram is not supported)
  bool byte_fallback = false;
  bool add_dummy_prefix = true;
  bool remove_extra_whitespaces = true;
  bool escape_whitespaces = true;
  std::string normalizer_name;  // "identity" is the only rule set implemented
  bool has_precompiled_charsmap = false;
  int32_t unk_id = 0, bos_id = 1, eos_id = 2;
};

// Parses a serialized ModelProto. Errors say which field is malformed.
absl::StatusOr<SentencePieceSpec> ParseSentencePieceModel(absl::string_view bytes);

class SentencePieceBpe {
 public:
  explicit SentencePieceBpe(const SentencePieceSpec& spec);

  // Appends the ids of already-normalized text (spaces escaped as U+2581) to `out`.
  void Encode(absl::string_view normalized, std::vector<int32_t>& out) const;

 private:
  absl::flat_hash_map<std::string, int32_t> mergeable_;  // normal and user-defined pieces
  absl::flat_hash_map<std::string, int32_t> all_;        // every piece
  std::vector<float> scores_;
  std::vector<std::string> user_defined_;  // matched whole before merging, longest first
  bool byte_fallback_;
  int32_t unk_id_;
  int32_t byte_ids_[256];
};

}  // namespace infinigen
