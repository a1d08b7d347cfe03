// libFuzzer target for the public GenerateRequest as bytes, through what the router does before
// it queues a request: the UTF-8 scan of the string fields on the wire (common/grpc/utf8_scan.h,
// which names the bad field where protobuf would only fail), the parse, and the validation
// (frontend/request_validation.h). Properties: the scan finds an invalid field exactly when the
// bytes are a well-formed message that protobuf refuses for its UTF-8 (a message that parses
// has no invalid field); a request that validates has one non-empty input within the limits,
// and validates again after a serialize / parse round trip. Under ASan and UBSan.
#include <google/protobuf/stubs/logging.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "common/grpc/utf8_scan.h"
#include "frontend/request_validation.h"

// Protobuf logs every string it refuses; the fuzzer makes millions.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const std::string invalid =
      infinigen::FirstInvalidUtf8Field(*infinigen::v1::GenerateRequest::descriptor(), bytes);
  infinigen::v1::GenerateRequest request;
  const bool parsed = request.ParseFromArray(data, static_cast<int>(size));
  if (parsed && !invalid.empty()) __builtin_trap();  // the scan named a field protobuf accepted
  if (!parsed) return 0;
  const infinigen::RequestLimits limits{4096, 64, 100};
  const absl::Status st = infinigen::ValidateGenerateRequest(request, limits);
  if (!st.ok()) {
    if (st.code() != absl::StatusCode::kInvalidArgument || st.message().empty()) __builtin_trap();
    return 0;
  }
  if (static_cast<int64_t>(request.ByteSizeLong()) > limits.max_request_bytes) __builtin_trap();
  switch (request.input_case()) {
    case infinigen::v1::GenerateRequest::kText:
      if (request.text().empty()) __builtin_trap();
      break;
    case infinigen::v1::GenerateRequest::kTokenIds:
      if (request.token_ids().ids().empty() ||
          request.token_ids().ids_size() > limits.max_prompt_tokens) {
        __builtin_trap();
      }
      break;
    case infinigen::v1::GenerateRequest::kMessages:
      if (request.messages().messages().empty()) __builtin_trap();
      break;
    default:
      __builtin_trap();
  }
  // 0: the prompt only, which has no samples.
  if (request.stopping().has_max_new_tokens() &&
      (request.stopping().max_new_tokens() < 0 ||
       request.stopping().max_new_tokens() > limits.max_new_tokens_limit ||
       (request.stopping().max_new_tokens() == 0 && request.sampling().n() > 1))) {
    __builtin_trap();
  }
  infinigen::v1::GenerateRequest again;
  const std::string wire = request.SerializeAsString();
  if (!again.ParseFromString(wire) || !infinigen::ValidateGenerateRequest(again, limits).ok() ||
      !infinigen::FirstInvalidUtf8Field(*infinigen::v1::GenerateRequest::descriptor(), wire)
           .empty()) {
    __builtin_trap();
  }
  return 0;
}
