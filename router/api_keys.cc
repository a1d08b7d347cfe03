#include "router/api_keys.h"

#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace infinigen {
namespace {

// Compares every byte of the longer of the two whatever they hold.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= x ^ y;
  }
  // Keep the compiler from turning the loop into an early exit.
  volatile unsigned char result = diff;
  return result == 0;
}

}  // namespace

absl::StatusOr<ApiKeys> ApiKeys::Load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--api_keys_file: cannot read ", path));
  std::vector<std::string> keys;
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view key = absl::StripAsciiWhitespace(line);
    if (key.empty() || key[0] == '#') continue;
    keys.emplace_back(key);
  }
  if (keys.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--api_keys_file: ", path, " holds no key"));
  }
  return ApiKeys(std::move(keys));
}

int ApiKeys::Find(absl::string_view authorization) const {
  // The scheme is case-insensitive (RFC 9110, section 11.1): "bearer", "BEARER" work too.
  constexpr absl::string_view kBearer = "Bearer ";
  if (!absl::StartsWithIgnoreCase(authorization, kBearer)) return -1;
  const absl::string_view given = authorization.substr(kBearer.size());
  int found = -1;
  for (size_t i = 0; i < keys_.size(); ++i) {  // no early exit
    if (ConstantTimeEquals(given, keys_[i])) found = static_cast<int>(i);
  }
  return found;
}

}  // namespace infinigen
