// The flags of a server's request limits (RequestLimits), declared once for infinigen-router,
// infinigen-worker and `infinigen serve`: --max-new-tokens-limit, --default-max-new-tokens,
// --max-prompt-tokens and, where the program receives public requests, --max-request-bytes.
#pragma once

#include "common/flags.h"
#include "frontend/request_validation.h"

namespace infinigen {

void RegisterRequestLimitFlags(FlagSet& flags, RequestLimits& limits, bool with_request_bytes);

}  // namespace infinigen
