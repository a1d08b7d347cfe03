#include "tests/support/test_paths.h"

#include <cstdlib>
#include <filesystem>

#include "common/npy.h"

namespace infinigen::testing {
namespace {

// The checkout and build folders compiled in, unless the environment names others (test binaries
// packed here and run on a GPU machine, where the checkout lies elsewhere: scripts/gpu/run.sh).
std::string Dir(const char* variable, const char* built_in) {
  const char* p = std::getenv(variable);
  return p != nullptr && *p ? p : built_in;
}

}  // namespace

std::string FixturePath(const std::string& relative) {
  return Dir("INFINIGEN_SOURCE_DIR", INFINIGEN_SOURCE_DIR) + "/tests/fixtures/" + relative;
}

std::string SharedTestdataPath(const std::string& relative) {
  return Dir("INFINIGEN_SOURCE_DIR", INFINIGEN_SOURCE_DIR) + "/../shared/testdata/" + relative;
}

std::string BinaryPath(const std::string& name) {
  return Dir("INFINIGEN_BINARY_DIR", INFINIGEN_BINARY_DIR) + "/bin/" + name;
}

std::string SmolLm2Path() {
  if (const char* p = std::getenv("INFINIGEN_SMOLLM2_GGUF"); p != nullptr && *p) return p;
  std::string cache;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x) {
    cache = x;
  } else if (const char* h = std::getenv("HOME"); h != nullptr) {
    cache = std::string(h) + "/.cache";
  }
  return cache + "/infinigen/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

bool RequireFile(const std::string& path, const std::string& what) {
  std::error_code ec;
  return std::filesystem::exists(path, ec);
}

std::vector<int32_t> NpyInts(const std::string& path) {
  std::vector<int32_t> out;
  auto arr = ReadNpy(path);
  if (!arr.ok()) {
    ADD_FAILURE() << arr.status();
    return out;
  }
  auto ints = arr->AsInt();
  if (!ints.ok()) {
    ADD_FAILURE() << path << ": " << ints.status();
    return out;
  }
  for (int64_t v : *ints) out.push_back(static_cast<int32_t>(v));
  return out;
}

std::vector<float> NpyFloats(const std::string& path) {
  auto arr = ReadNpy(path);
  if (!arr.ok()) {
    ADD_FAILURE() << arr.status();
    return {};
  }
  auto floats = arr->AsFloat();
  if (!floats.ok()) {
    ADD_FAILURE() << path << ": " << floats.status();
    return {};
  }
  return *floats;
}

}  // namespace infinigen::testing
