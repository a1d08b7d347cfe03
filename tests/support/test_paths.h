// Where tests find their data: committed fixtures, ../shared/testdata, the SmolLM2 model that
// scripts/setup.sh fetches, and the built binaries.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace infinigen::testing {

// tests/fixtures/<relative>.
std::string FixturePath(const std::string& relative);
// ../shared/testdata/<relative> (next to the checkout).
std::string SharedTestdataPath(const std::string& relative);
// build/bin/<name>.
std::string BinaryPath(const std::string& name);
// The SmolLM2-135M-Instruct Q4_1 GGUF: $INFINIGEN_SMOLLM2_GGUF, else the setup cache.
std::string SmolLm2Path();

// Whether `path` exists. If it does not: under CI (CI set) the test fails naming the path,
// otherwise it is skipped with that message. Use as: if (!RequireFile(p)) return;
bool RequireFile(const std::string& path, const std::string& what);
#define IG_REQUIRE_FILE(path, what)                                                  \
  do {                                                                               \
    if (!::infinigen::testing::RequireFile(path, what)) {                            \
      if (std::getenv("CI") != nullptr) FAIL() << (what) << " missing: " << (path);  \
      GTEST_SKIP() << (what) << " missing: " << (path) << " (run scripts/setup.sh)"; \
    }                                                                                \
  } while (0)

}  // namespace infinigen::testing

namespace infinigen::testing {

// The values of a .npy fixture (int or float); records a test failure if it cannot be read.
std::vector<int32_t> NpyInts(const std::string& path);
std::vector<float> NpyFloats(const std::string& path);

}  // namespace infinigen::testing
