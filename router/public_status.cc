#include "router/public_status.h"

#include <cctype>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"

namespace infinigen {
namespace {

constexpr absl::string_view kRedacted = "<internal>";

bool IsDigit(char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; }

// Length of a dotted-quad IPv4 address at s[0] (with ":port" if one follows), or 0.
size_t Ipv4At(absl::string_view s) {
  size_t i = 0;
  for (int part = 0; part < 4; ++part) {
    if (part > 0) {
      if (i >= s.size() || s[i] != '.') return 0;
      ++i;
    }
    const size_t start = i;
    while (i < s.size() && IsDigit(s[i]) && i - start < 3) ++i;
    if (i == start) return 0;
  }
  if (i < s.size() && IsDigit(s[i])) return 0;  // a longer number: not an address
  if (i + 1 < s.size() && s[i] == ':' && IsDigit(s[i + 1])) {
    ++i;
    while (i < s.size() && IsDigit(s[i])) ++i;
  }
  return i;
}

// Length of a gRPC target URI at s[0] ("ipv4:...", "ipv6:...", "unix:...", "dns:..."), up to
// the next space, comma or closing bracket/quote, or 0.
size_t UriAt(absl::string_view s) {
  for (absl::string_view scheme : {"ipv4:", "ipv6:", "unix:", "unix-abstract:", "dns:"}) {
    if (!absl::StartsWith(s, scheme)) continue;
    size_t i = scheme.size();
    while (i < s.size() && !absl::ascii_isspace(static_cast<unsigned char>(s[i])) && s[i] != ',' &&
           s[i] != ')' && s[i] != '"' && s[i] != '\'' && s[i] != ';') {
      ++i;
    }
    while (i > scheme.size() && (s[i - 1] == ':' || s[i - 1] == '.')) --i;  // punctuation
    return i;
  }
  return 0;
}

// Length of a bracketed IPv6 address "[...]" (with ":port"), or 0.
size_t Ipv6At(absl::string_view s) {
  if (s.empty() || s[0] != '[') return 0;
  const size_t close = s.find(']');
  if (close == absl::string_view::npos || close < 3) return 0;
  for (size_t i = 1; i < close; ++i) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(s[i])) && s[i] != ':' && s[i] != '.') {
      return 0;
    }
  }
  size_t i = close + 1;
  if (i + 1 < s.size() && s[i] == ':' && IsDigit(s[i + 1])) {
    ++i;
    while (i < s.size() && IsDigit(s[i])) ++i;
  }
  return i;
}

}  // namespace

std::string RedactAddresses(absl::string_view message) {
  std::string out;
  out.reserve(message.size());
  for (size_t i = 0; i < message.size();) {
    const absl::string_view rest = message.substr(i);
    const bool boundary =
        i == 0 || !absl::ascii_isalnum(static_cast<unsigned char>(message[i - 1]));
    size_t n = 0;
    if (boundary) {
      n = UriAt(rest);
      if (n == 0) n = Ipv4At(rest);
      if (n == 0) n = Ipv6At(rest);
    }
    if (n > 0) {
      out.append(kRedacted.data(), kRedacted.size());
      i += n;
    } else {
      out.push_back(message[i++]);
    }
  }
  return out;
}

grpc::Status ForClients(const grpc::Status& status) {
  if (status.ok()) return status;
  std::string message = RedactAddresses(status.error_message());
  if (message == status.error_message()) return status;
  return grpc::Status(status.error_code(), std::move(message), status.error_details());
}

}  // namespace infinigen
