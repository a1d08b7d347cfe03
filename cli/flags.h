// A small command-line parser for the CLI's subcommands: each command declares its flags
// (with help text) and gets a one-line error for anything it does not know.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace infinigen::cli {

class FlagSet {
 public:
  FlagSet(std::string command, std::string usage, std::string summary);

  void String(const std::string& name, std::string* value, const std::string& help);
  void Int(const std::string& name, int64_t* value, const std::string& help);
  // A value outside int32's range is an error naming the flag (not a silent wrap).
  void Int(const std::string& name, int32_t* value, const std::string& help);
  void Float(const std::string& name, double* value, const std::string& help);
  void Bool(const std::string& name, bool* value, const std::string& help);

  // Parses argv (after the command name). Names are declared with dashes; underscores are
  // accepted for them (--max_new_tokens_limit = --max-new-tokens-limit, as the service binaries
  // spell it). Returns false when --help was asked for (the help is printed), an
  // INVALID_ARGUMENT error naming the flag for anything malformed.
  absl::StatusOr<bool> Parse(int argc, char** argv);
  std::string Help() const;
  // Whether the flag appeared on the command line.
  bool WasSet(const std::string& name) const;

 private:
  struct Flag {
    std::string name, help, kind;
    std::string default_text;
    std::function<bool(const std::string&)> set;
    bool needs_value = true;
    bool seen = false;
  };
  Flag* Find(const std::string& name);

  std::string command_, usage_, summary_;
  std::vector<Flag> flags_;
};

// Prints "infinigen <command>: <message>" on stderr and returns the exit code for `status`:
// 2 for errors the user can fix in the command line (bad flag, missing file, bad value), else 1.
int ReportError(const std::string& command, const absl::Status& status);

// Parses --chat '[{"role": "user", "content": "..."}]' into (role, content) pairs.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseChatFlag(
    const std::string& json);

// Parses "1,2,3" into ids.
absl::StatusOr<std::vector<int32_t>> ParseIdList(const std::string& text, const std::string& flag);

}  // namespace infinigen::cli
