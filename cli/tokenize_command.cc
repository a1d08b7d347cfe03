#include <iostream>
#include <string>

#include "absl/strings/str_cat.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "gpu_worker/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

namespace infinigen::cli {

int RunTokenize(int argc, char** argv) {
  std::string path, text;
  bool jsonl = false, add_special = false, decode = false, skip_special = false;
  FlagSet flags("infinigen tokenize", "--tokenizer PATH (--jsonl | --text TEXT) [flags]",
                "Encodes text to token ids, or with --decode ids to text. With --jsonl, reads one "
                "JSON value per line on stdin (a string to encode, or an array of ids to decode) "
                "and prints one JSON value per line.");
  flags.String("tokenizer", &path,
               "tokenizer.json, tokenizer.model, a .gguf, or a folder with one of them or "
               "vocab.json + merges.txt (a model folder works)");
  flags.Bool("jsonl", &jsonl, "read JSON lines from stdin");
  flags.String("text", &text, "a single text to encode (instead of --jsonl)");
  flags.Bool("add-special", &add_special, "add the tokenizer's BOS/EOS when encoding");
  flags.Bool("decode", &decode, "decode arrays of ids instead of encoding text");
  flags.Bool("skip-special", &skip_special, "leave special tokens out when decoding");
  auto parsed = flags.Parse(argc, argv);
  if (!parsed.ok()) return ReportError("tokenize", parsed.status());
  if (!*parsed) return 0;
  if (path.empty()) {
    return ReportError("tokenize", absl::InvalidArgumentError("--tokenizer is required"));
  }
  if (jsonl == flags.WasSet("text")) {
    return ReportError("tokenize",
                       absl::InvalidArgumentError("give exactly one of --jsonl and --text"));
  }
  auto tok = Tokenizer::Load(path);
  if (!tok.ok()) return ReportError("tokenize", tok.status());
  if (!jsonl) {
    std::cout << nlohmann::json((*tok)->Encode(text, add_special)).dump() << "\n";
    return 0;
  }
  std::string line;
  int64_t line_no = 0;
  while (std::getline(std::cin, line)) {
    ++line_no;
    const auto value = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (decode) {
      if (!value.is_array() || !std::all_of(value.begin(), value.end(),
                                            [](const auto& v) { return v.is_number_integer(); })) {
        return ReportError(
            "tokenize", absl::InvalidArgumentError(absl::StrCat("stdin line ", line_no,
                                                                ": expected a JSON array of ids")));
      }
      const auto ids = value.get<std::vector<int32_t>>();
      std::cout << nlohmann::json((*tok)->Decode(ids, skip_special)).dump() << "\n";
    } else {
      if (!value.is_string()) {
        return ReportError("tokenize", absl::InvalidArgumentError(absl::StrCat(
                                           "stdin line ", line_no, ": expected a JSON string")));
      }
      std::cout << nlohmann::json((*tok)->Encode(value.get<std::string>(), add_special)).dump()
                << "\n";
    }
  }
  return 0;
}

}  // namespace infinigen::cli
