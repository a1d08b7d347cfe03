#include "frontend/limit_flags.h"

namespace infinigen {

void RegisterRequestLimitFlags(FlagSet& flags, RequestLimits& limits, bool with_request_bytes) {
  flags.Int("max-new-tokens-limit", &limits.max_new_tokens_limit,
            "the most max_new_tokens a request may ask");
  flags.Int("default-max-new-tokens", &limits.default_max_new_tokens,
            "max_new_tokens of requests that give none (0: 256, or max_new_tokens_limit if less)");
  flags.Int("max-prompt-tokens", &limits.max_prompt_tokens,
            "the most prompt tokens a request may have (0: the model's context)");
  if (with_request_bytes) {
    flags.Int("max-request-bytes", &limits.max_request_bytes,
              "the largest request message, in bytes");
  }
}

}  // namespace infinigen
