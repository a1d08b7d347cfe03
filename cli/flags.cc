#include "cli/flags.h"

#include <cstdio>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

namespace infinigen::cli {

int ReportError(const std::string& command, const absl::Status& status) {
  std::string msg(status.message());
  for (char& ch : msg) {
    if (ch == '\n') ch = ' ';
  }
  std::cerr << "infinigen " << command << ": " << msg << "\n";
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      return 2;
    default:
      return 1;
  }
}

absl::StatusOr<std::vector<int32_t>> ParseIdList(const std::string& text, const std::string& flag) {
  std::vector<int32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int32_t id;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": '", part, "' is not a token id (expected e.g. 1,2,3)"));
    }
    ids.push_back(id);
  }
  if (ids.empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, " is empty"));
  return ids;
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseChatFlag(
    const std::string& json) {
  const auto j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  auto bad = absl::InvalidArgumentError(
      "--chat must be a JSON array of {\"role\": ..., \"content\": ...} objects");
  if (!j.is_array() || j.empty()) return bad;
  std::vector<std::pair<std::string, std::string>> messages;
  for (const auto& m : j) {
    if (!m.is_object() || !m.contains("role") || !m.contains("content") || !m["role"].is_string() ||
        !m["content"].is_string()) {
      return bad;
    }
    messages.emplace_back(m["role"].get<std::string>(), m["content"].get<std::string>());
  }
  return messages;
}

}  // namespace infinigen::cli
