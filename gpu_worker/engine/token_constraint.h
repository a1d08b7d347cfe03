// What a request's text must be, as a mask over the next token's logits (structured output:
// OpenAI's `response_format`). The engine masks each sequence's logits before sampling
// (after logit_bias and min_tokens, before the penalties and temperature: a masked token keeps
// -infinity through them) and hands the drawn token back; the logprobs it reports are the
// model's own, before any mask. One object per sequence, used by the engine's thread only.
#pragma once

#include <cstdint>
#include <span>

namespace infinigen {

class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;
  // Sets to -infinity the logits in `row` [vocab] of the tokens that may not come next. The
  // tokens of `stops` end the sequence: they may come where the text may end, and where they
  // continue it (the text then ends there, cut). False when no token may come next.
  virtual bool Mask(std::span<float> row, std::span<const int32_t> stops) = 0;
  // Takes `token` as the next one; false when it may not come.
  virtual bool Accept(int32_t token) = 0;
  // The text is whole: the sequence ends here.
  virtual bool Complete() const = 0;
};

}  // namespace infinigen
