// `infinigen load --api openai`: one stream of streamed POST /v1/completions requests, back to
// back on one keep-alive HTTP connection, against the OpenAI-compatible front door
// (openai/http_front_door.h). A token's arrival is its server-sent event's.
#pragma once

#include <string>

#include "cli/load_samples.h"

namespace infinigen::cli {

// `address` is host:port of the HTTP front door; `api_key` may be empty.
void DriveOpenAi(const std::string& address, const std::string& api_key, const LoadSpec& spec,
                 int stream, Samples& out);

}  // namespace infinigen::cli
