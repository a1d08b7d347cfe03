// The one command-line flag parser of every program here (infinigen-worker, infinigen-router,
// infinigen-kvstore and the `infinigen` commands): each program declares its flags onto the
// fields of its config struct (with help text), so a flag shared by two programs (the worker's
// and `infinigen serve`'s) is declared once, by one registration function. Names are declared
// with dashes and may be written with underscores (--max_new_tokens_limit); --flagfile=a,b
// reads flags from files (one per line, # comments), as Kubernetes mounts them; --help lists
// the program's own flags. Anything unknown or malformed is an error naming the flag.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace infinigen {

class FlagSet {
 public:
  // `program`: "infinigen-worker", "infinigen serve"; `usage` follows it on --help's first line.
  FlagSet(std::string program, std::string usage, std::string summary);

  void String(const std::string& name, std::string* value, const std::string& help);
  void Int(const std::string& name, int64_t* value, const std::string& help);
  // A value outside int32's range is an error naming the flag (not a silent wrap).
  void Int(const std::string& name, int32_t* value, const std::string& help);
  void Float(const std::string& name, double* value, const std::string& help);
  // --name, --name=true/false/1/0.
  void Bool(const std::string& name, bool* value, const std::string& help);
  // Whole milliseconds or seconds (the name says which, e.g. --stall_timeout_ms).
  void Milliseconds(const std::string& name, absl::Duration* value, const std::string& help);
  void Seconds(const std::string& name, absl::Duration* value, const std::string& help);

  // Parses argv (without the program's name). Returns false when --help was asked for (the
  // help is printed on stdout), an INVALID_ARGUMENT error naming the flag for anything
  // malformed, NOT_FOUND for a flag file that cannot be read.
  absl::StatusOr<bool> Parse(int argc, char** argv);
  std::string Help() const;
  // Whether the flag appeared on the command line (or in a flag file).
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
  absl::Status ParseArgs(const std::vector<std::string>& args, int depth);
  absl::Status ReadFlagFiles(const std::string& paths, int depth);

  std::string program_, usage_, summary_;
  std::vector<Flag> flags_;
  bool help_ = false;
};

}  // namespace infinigen
