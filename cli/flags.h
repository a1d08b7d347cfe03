// What the CLI's commands share about their command lines: the flag parser (common/flags.h),
// one-line errors with the exit code, and the values of --chat and --prompt-ids.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/flags.h"

namespace infinigen::cli {

// The flag parser every program shares (common/flags.h).
using ::infinigen::FlagSet;

// Prints "infinigen <command>: <message>" on stderr and returns the exit code for `status`:
// 2 for errors the user can fix in the command line (bad flag, missing file, bad value), else 1.
int ReportError(const std::string& command, const absl::Status& status);

// Parses --chat '[{"role": "user", "content": "..."}]' into (role, content) pairs.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseChatFlag(
    const std::string& json);

// Parses "1,2,3" into ids.
absl::StatusOr<std::vector<int32_t>> ParseIdList(const std::string& text, const std::string& flag);

}  // namespace infinigen::cli
