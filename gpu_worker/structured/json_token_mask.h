// OpenAI's `response_format: {"type": "json_object"}` over a tokenizer's vocabulary: a token may
// come next only when the text with its bytes is still a prefix of one JSON object
// (gpu_worker/structured/json_prefix.h); special tokens never come (end-of-sequence tokens only
// once the object is whole), and the sequence is whole when the object closes. The vocabulary's
// bytes are read once per model (JsonVocabulary) and shared by every sequence's mask.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gpu_worker/engine/token_constraint.h"
#include "gpu_worker/structured/json_prefix.h"

namespace infinigen {

class Tokenizer;

// Each token id's bytes as it adds them to the text; special tokens (and ids without bytes)
// are marked, and never continue a JSON text.
struct JsonVocabulary {
  std::vector<std::string> bytes;
  std::vector<uint8_t> usable;  // per id: 1 when the token may be part of the text
  // Per id: 1 when its bytes may stand anywhere inside a string (no '"', '\\' or control
  // byte, whole UTF-8 characters): most of a vocabulary, let through there without reading.
  std::vector<uint8_t> plain;
  // Per id, what Mask reads of every token, packed so that its pass over the vocabulary reads
  // 4 bytes a token: the first two bytes, whether there are more than two, usable and plain.
  std::vector<uint32_t> head;
  static constexpr uint32_t kTwo = 1u << 16, kLonger = 1u << 17, kUsable = 1u << 18,
                            kPlain = 1u << 19;

  // Fills `plain` and `head` from `bytes` and `usable`.
  void Classify();

  static std::shared_ptr<const JsonVocabulary> FromTokenizer(const Tokenizer& tokenizer);
};

class JsonTokenMask final : public TokenConstraint {
 public:
  explicit JsonTokenMask(std::shared_ptr<const JsonVocabulary> vocabulary)
      : vocabulary_(std::move(vocabulary)) {}

  bool Mask(std::span<float> row, std::span<const int32_t> stops) override;
  bool Accept(int32_t token) override;
  bool Complete() const override { return state_.Complete(); }

 private:
  std::shared_ptr<const JsonVocabulary> vocabulary_;
  JsonPrefix state_{/*object_only=*/true};
  std::vector<float> stop_logits_;  // Mask's scratch
};

}  // namespace infinigen
