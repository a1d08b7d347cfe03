// API keys for the router: a file with one key per line (blank lines and lines starting with
// '#' ignored), checked against `authorization: Bearer <key>` in constant time per key, so the
// time a check takes does not reveal how much of a key was right. Keys are never logged.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace infinigen {

class ApiKeys {
 public:
  // INVALID_ARGUMENT when the file cannot be read or holds no key.
  static absl::StatusOr<ApiKeys> Load(const std::string& path);
  explicit ApiKeys(std::vector<std::string> keys) : keys_(std::move(keys)) {}

  // Whether `authorization` (the header's value) is "Bearer " and one of the keys.
  bool Accepts(absl::string_view authorization) const { return Find(authorization) >= 0; }
  // Which key it is (its index in the file's order), or -1; every key is compared in full.
  int Find(absl::string_view authorization) const;
  size_t size() const { return keys_.size(); }

 private:
  std::vector<std::string> keys_;
};

}  // namespace infinigen
