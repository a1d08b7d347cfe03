// An error of the OpenAI-compatible API as its clients expect it (docs/api.md): an HTTP status
// and a body {"error": {...}} naming the field at fault.
#pragma once

#include <string>
#include <utility>

#include "nlohmann/json.hpp"

namespace infinigen::openai {

// An error as OpenAI's clients expect it: an HTTP status and {"error": {...}}.
struct ApiError {
  ApiError() = default;
  ApiError(int status, std::string text, std::string error_type = "invalid_request_error",
           std::string field = "", std::string error_code = "")
      : http_status(status),
        message(std::move(text)),
        type(std::move(error_type)),
        param(std::move(field)),
        code(std::move(error_code)) {}

  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;            // the request field at fault; empty: null
  std::string code;             // empty: null
  int retry_after_seconds = 0;  // sent as Retry-After when > 0 (429, 503)
};
// Its body: {"error": {"message", "type", "param", "code"}}.
inline std::string ErrorJson(const ApiError& e) {
  using nlohmann::json;
  json error = {{"message", e.message},
                {"type", e.type},
                {"param", e.param.empty() ? json() : json(e.param)},
                {"code", e.code.empty() ? json() : json(e.code)}};
  return json{{"error", std::move(error)}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace infinigen::openai
