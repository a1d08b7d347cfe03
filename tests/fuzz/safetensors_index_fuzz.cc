// libFuzzer target for a sharded checkpoint's model.safetensors.index.json
// (ParseSafetensorsIndex): arbitrary bytes as the index. Whatever the bytes, the parse returns
// INVALID_ARGUMENT naming the index, or shard names that are plain file names of the index's
// folder (what Checkpoint::Open then joins to the folder and maps): not empty, no '/', not "."
// or "..", no NUL byte, sorted, each once. Under ASan and UBSan. Seeds (scripts/fuzz.sh): the
// fixtures' real index and small variants of it.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/string_view.h"
#include "gpu_worker/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  auto shards = infinigen::ParseSafetensorsIndex(text, "fuzz.index.json");
  if (!shards.ok()) {
    if (shards.status().code() != absl::StatusCode::kInvalidArgument ||
        shards.status().message().find("fuzz.index.json") == absl::string_view::npos) {
      std::fprintf(stderr, "unexpected error: %s\n", shards.status().ToString().c_str());
      std::abort();
    }
    return 0;
  }
  if (shards->empty()) std::abort();
  for (size_t i = 0; i < shards->size(); ++i) {
    const std::string& f = (*shards)[i];
    if (f.empty() || f == "." || f == ".." || f.find('/') != std::string::npos ||
        f.find('\0') != std::string::npos) {
      std::fprintf(stderr, "a shard name outside the folder: '%s'\n", f.c_str());
      std::abort();
    }
    if (i > 0 && !((*shards)[i - 1] < f)) std::abort();  // sorted, each once
  }
  return 0;
}
