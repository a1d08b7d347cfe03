#include "cli/flags.h"

#include <algorithm>
#include <cstdio>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

namespace infinigen::cli {

FlagSet::FlagSet(std::string command, std::string usage, std::string summary)
    : command_(std::move(command)), usage_(std::move(usage)), summary_(std::move(summary)) {}

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
           if (v.empty() || v == "true" || v == "1")
             *value = true;
           else if (v == "false" || v == "0")
             *value = false;
           else
             return false;
           return true;
         }};
  f.needs_value = false;
  flags_.push_back(std::move(f));
}

FlagSet::Flag* FlagSet::Find(const std::string& name) {
  for (Flag& f : flags_) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

bool FlagSet::WasSet(const std::string& name) const {
  for (const Flag& f : flags_) {
    if (f.name == name) return f.seen;
  }
  return false;
}

absl::StatusOr<bool> FlagSet::Parse(int argc, char** argv) {
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << Help();
      return false;
    }
    if (arg.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument '", argv[i], "' (see --help)"));
    }
    arg = arg.substr(2);
    std::string value;
    bool has_value = false;
    if (size_t eq = arg.find('='); eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    // --max_new_tokens_limit is --max-new-tokens-limit: the service binaries spell their flags
    // with underscores (absl), and a flag copied from their flag files works here too.
    std::string name = arg;
    std::replace(name.begin(), name.end(), '_', '-');
    Flag* f = Find(name);
    if (f == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", arg, " (see --help)"));
    }
    if (f->needs_value && !has_value) {
      if (i + 1 >= argc) {
        return absl::InvalidArgumentError(absl::StrCat("flag --", arg, " needs a value"));
      }
      value = argv[++i];
    }
    if (!f->set(value)) {
      return absl::InvalidArgumentError(absl::StrCat("flag --", arg, ": '", value,
                                                     "' is not a valid ",
                                                     f->kind.empty() ? "true/false" : f->kind));
    }
    f->seen = true;
  }
  return true;
}

std::string FlagSet::Help() const {
  std::string out =
      absl::StrCat("usage: infinigen ", command_, " ", usage_, "\n\n", summary_, "\n\nflags:\n");
  for (const Flag& f : flags_) {
    std::string left = absl::StrCat("  --", f.name, f.kind.empty() ? "" : " " + f.kind);
    absl::StrAppendFormat(&out, "%-28s %s", left, f.help);
    if (!f.default_text.empty() && f.default_text != "0" && f.default_text != "false") {
      absl::StrAppend(&out, " (default: ", f.default_text, ")");
    }
    absl::StrAppend(&out, "\n");
  }
  absl::StrAppend(&out, "  --help                       this help\n");
  return out;
}

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
