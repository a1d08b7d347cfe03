#include "common/flags.h"

#include <algorithm>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace infinigen {
namespace {

// Flag files may name flag files; deeper than this is a cycle.
constexpr int kMaxFlagFileDepth = 8;

std::string Canonical(std::string name) {
  std::replace(name.begin(), name.end(), '_', '-');
  return name;
}

}  // namespace

FlagSet::FlagSet(std::string program, std::string usage, std::string summary)
    : program_(std::move(program)), usage_(std::move(usage)), summary_(std::move(summary)) {}

void FlagSet::String(const std::string& name, std::string* value, const std::string& help) {
  flags_.push_back({name, help, "TEXT", *value, [value](const std::string& v) {
                      *value = v;
                      return true;
                    }});
}

void FlagSet::Int(const std::string& name, int64_t* value, const std::string& help) {
  flags_.push_back({name, help, "N", absl::StrCat(*value),
                    [value](const std::string& v) { return absl::SimpleAtoi(v, value); }});
}

void FlagSet::Int(const std::string& name, int32_t* value, const std::string& help) {
  flags_.push_back({name, help, "N", absl::StrCat(*value),
                    [value](const std::string& v) { return absl::SimpleAtoi(v, value); }});
}

void FlagSet::Float(const std::string& name, double* value, const std::string& help) {
  flags_.push_back({name, help, "X", absl::StrCat(*value),
                    [value](const std::string& v) { return absl::SimpleAtod(v, value); }});
}

void FlagSet::Bool(const std::string& name, bool* value, const std::string& help) {
  Flag f{name, help, "", *value ? "true" : "false", [value](const std::string& v) {
           if (v.empty() || v == "true" || v == "1") {
             *value = true;
           } else if (v == "false" || v == "0") {
             *value = false;
           } else {
             return false;
           }
           return true;
         }};
  f.needs_value = false;
  flags_.push_back(std::move(f));
}

void FlagSet::Milliseconds(const std::string& name, absl::Duration* value,
                           const std::string& help) {
  flags_.push_back({name, help, "MS", absl::StrCat(absl::ToInt64Milliseconds(*value)),
                    [value](const std::string& v) {
                      int64_t ms = 0;
                      if (!absl::SimpleAtoi(v, &ms)) return false;
                      *value = absl::Milliseconds(ms);
                      return true;
                    }});
}

void FlagSet::Seconds(const std::string& name, absl::Duration* value, const std::string& help) {
  flags_.push_back(
      {name, help, "S", absl::StrCat(absl::ToInt64Seconds(*value)), [value](const std::string& v) {
         int64_t s = 0;
         if (!absl::SimpleAtoi(v, &s)) return false;
         *value = absl::Seconds(s);
         return true;
       }});
}

FlagSet::Flag* FlagSet::Find(const std::string& name) {
  const std::string canonical = Canonical(name);
  for (Flag& f : flags_) {
    if (f.name == canonical) return &f;
  }
  return nullptr;
}

bool FlagSet::WasSet(const std::string& name) const {
  const std::string canonical = Canonical(name);
  for (const Flag& f : flags_) {
    if (f.name == canonical) return f.seen;
  }
  return false;
}

absl::StatusOr<bool> FlagSet::Parse(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  absl::Status st = ParseArgs(args, 0);
  if (!st.ok()) return st;
  if (help_) {
    std::cout << Help();
    return false;
  }
  return true;
}

absl::Status FlagSet::ParseArgs(const std::vector<std::string>& args, int depth) {
  for (size_t i = 0; i < args.size(); ++i) {
    std::string arg = args[i];
    if (arg == "--help" || arg == "-h") {
      help_ = true;
      return absl::OkStatus();
    }
    if (arg.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument '", args[i], "' (see --help)"));
    }
    arg = arg.substr(2);
    std::string value;
    bool has_value = false;
    if (size_t eq = arg.find('='); eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    if (arg == "flagfile") {
      if (!has_value) {
        if (i + 1 >= args.size())
          return absl::InvalidArgumentError("flag --flagfile needs a value");
        value = args[++i];
      }
      if (absl::Status st = ReadFlagFiles(value, depth + 1); !st.ok()) return st;
      if (help_) return absl::OkStatus();
      continue;
    }
    Flag* f = Find(arg);
    if (f == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", arg, " (see --help)"));
    }
    if (f->needs_value && !has_value) {
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(absl::StrCat("flag --", arg, " needs a value"));
      }
      value = args[++i];
    }
    if (!f->set(value)) {
      return absl::InvalidArgumentError(absl::StrCat("flag --", arg, ": '", value,
                                                     "' is not a valid ",
                                                     f->kind.empty() ? "true/false" : f->kind));
    }
    f->seen = true;
  }
  return absl::OkStatus();
}

absl::Status FlagSet::ReadFlagFiles(const std::string& paths, int depth) {
  if (depth > kMaxFlagFileDepth) {
    return absl::InvalidArgumentError(
        absl::StrCat("--flagfile: flag files nest deeper than ", kMaxFlagFileDepth, " (a cycle?)"));
  }
  for (absl::string_view path : absl::StrSplit(paths, ',', absl::SkipEmpty())) {
    std::ifstream in{std::string(path)};
    if (!in) {
      return absl::NotFoundError(absl::StrCat("--flagfile: cannot read '", path, "'"));
    }
    std::vector<std::string> args;
    std::string line;
    while (std::getline(in, line)) {
      absl::string_view l = absl::StripAsciiWhitespace(line);
      if (l.empty() || l[0] == '#') continue;
      args.emplace_back(l);
    }
    if (absl::Status st = ParseArgs(args, depth); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat(path, ": ", st.message()));
    }
  }
  return absl::OkStatus();
}

std::string FlagSet::Help() const {
  std::string out = absl::StrCat("usage: ", program_, " ", usage_, "\n\n", summary_,
                                 "\n\nflags (--a-b or --a_b):\n");
  for (const Flag& f : flags_) {
    std::string left = absl::StrCat("  --", f.name, f.kind.empty() ? "" : " " + f.kind);
    absl::StrAppendFormat(&out, "%-28s %s", left, f.help);
    if (!f.default_text.empty() && f.default_text != "0" && f.default_text != "false") {
      absl::StrAppend(&out, " (default: ", f.default_text, ")");
    }
    absl::StrAppend(&out, "\n");
  }
  absl::StrAppend(&out, "  --flagfile FILE[,FILE]       read flags from files, one per line\n");
  absl::StrAppend(&out, "  --help                       this help\n");
  return out;
}

}  // namespace infinigen
