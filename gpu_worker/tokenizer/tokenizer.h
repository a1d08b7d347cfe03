// Tokenizer: text <-> token ids for every format the project reads. One pipeline, configured by
// the loader: added/special tokens are matched first; the text between them is normalized,
// split into pieces, and encoded by a subword model (Hugging Face BPE or SentencePiece BPE);
// decoding maps tokens back to bytes.
//
// Invalid UTF-8 input is replaced (one U+FFFD per maximal invalid subsequence) before
// tokenizing; decoded text is valid UTF-8 with the same replacement.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gpu_worker/tokenizer/bpe.h"
#include "gpu_worker/tokenizer/pre_tokenizer.h"
#include "gpu_worker/tokenizer/sentencepiece.h"

namespace infinigen {

struct GgufFile;

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = true;        // skipped by Decode(skip_special = true)
  bool lstrip = false;        // absorbs whitespace to its left
  bool rstrip = false;        // absorbs whitespace to its right
  bool match_in_text = true;  // false: only ever produced by ids (SentencePiece control pieces)
};

// How a tokenizer is put together; loaders fill it in (tokenizer_loaders.cc).
struct TokenizerSpec {
  // Normalizer, applied to each text segment between added tokens.
  bool collapse_spaces = false;  // SentencePiece remove_extra_whitespaces: trim, single spaces
  std::string prepend;           // prefixed to a non-empty segment (SentencePiece's dummy prefix)
  std::vector<std::pair<std::string, std::string>> replacements;  // applied in order
  // Pre-tokenizer.
  bool split_digits = false;
  SplitPattern split = SplitPattern::kNone;
  bool byte_level = false;  // map bytes to GPT-2's printable characters
  bool byte_level_prefix_space = false;
  // Subword model.
  std::variant<std::monostate, BpeModel, SentencePieceBpe> model;
  // Decoder.
  enum class Decoder { kByteLevel, kSentencePiece };
  Decoder decoder = Decoder::kByteLevel;
  bool decoder_strips_leading_space = false;  // SentencePiece's dummy prefix comes off again
  // Vocabulary as the model spells it (byte-level characters or U+2581 pieces).
  std::vector<std::string> id_to_token;
  std::vector<AddedToken> added;
  // Post-processing (when encoding with add_special).
  std::vector<int32_t> prefix_ids, suffix_ids;
  int32_t bos_id = -1;
  std::vector<int32_t> eos_ids;
  std::string chat_template;
};

class Tokenizer {
 public:
  // `path`: tokenizer.json, tokenizer.model, a .gguf file, or a folder holding one of those
  // or vocab.json + merges.txt (with tokenizer_config.json beside a tokenizer.json when present).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& path);
  // The tokenizer embedded in a GGUF (tokenizer.ggml.model = gpt2 or llama).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromGguf(const GgufFile& gguf,
                                                             const std::string& path);
  // Validates `spec` (ids in range, a model present).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Create(TokenizerSpec spec);

  // Token ids of `text`. Special-token text in it is always recognized; `add_special` adds the
  // BOS/EOS the tokenizer's post-processor defines.
  std::vector<int32_t> Encode(absl::string_view text, bool add_special = false) const;
  // Text of `ids` (unknown ids are skipped).
  std::string Decode(std::span<const int32_t> ids, bool skip_special = false) const;

  int32_t vocab_size() const { return static_cast<int32_t>(spec_.id_to_token.size()); }
  int32_t bos_id() const { return spec_.bos_id; }
  const std::vector<int32_t>& eos_ids() const { return spec_.eos_ids; }
  bool IsSpecial(int32_t id) const;
  // The token as the vocabulary spells it (e.g. "Ġthe", "▁the", "<|eot_id|>").
  const std::string& TokenText(int32_t id) const;
  // Id of an exact token string (added tokens included), or -1.
  int32_t TokenId(absl::string_view text) const;
  const std::string& chat_template() const { return spec_.chat_template; }

  // Raw bytes token `id` stands for (byte-level mapping undone, U+2581 turned back into
  // spaces); `first` drops the SentencePiece dummy-prefix space. For streaming decode.
  void AppendTokenBytes(int32_t id, bool first, std::string& out) const;

 private:
  explicit Tokenizer(TokenizerSpec spec);
  void EncodeSegment(absl::string_view text, std::vector<int32_t>& out) const;

  TokenizerSpec spec_;
  absl::flat_hash_map<std::string, int32_t> token_to_id_;
  static constexpr uint8_t kAdded = 1, kSpecial = 2;
  std::vector<uint8_t> flags_;  // per id
  // SentencePiece-style text with no pre-tokenizer is one long "word"; when no vocabulary
  // entry holds a U+2581 right after another character, no merge can cross the start of a
  // ▁-word, and encoding word by word gives the same ids in linear time.
  bool split_at_space_symbol_ = false;
  // Added tokens by first byte, longest first, for leftmost-longest matching.
  std::vector<std::vector<int32_t>> added_by_first_byte_;
};

// Streaming detokenizer: feed tokens one at a time and get text deltas that never split a
// UTF-8 character; the concatenated deltas (plus Finish()) equal Decode() of all the tokens.
class IncrementalDecoder {
 public:
  IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special);
  // Text that became complete with `id` (possibly empty).
  std::string Add(int32_t id);
  // Whatever is still held back (an unfinished UTF-8 sequence, replaced).
  std::string Finish();

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_;
  bool first_ = true;
  std::string pending_;
};

}  // namespace infinigen
