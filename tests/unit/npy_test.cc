#include "common/npy.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

namespace infinigen {
namespace {

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("infinigen_npy_" + name)).string();
}

TEST(Npy, WriteThenReadRoundTrips) {
  const std::string path = TempPath("rt.npy");
  std::vector<float> data = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, -0.5f};
  ASSERT_TRUE(WriteNpyF32(path, {2, 3}, data.data()).ok());
  auto arr = ReadNpy(path);
  ASSERT_TRUE(arr.ok()) << arr.status();
  EXPECT_EQ(arr->descr, "<f4");
  EXPECT_EQ(arr->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(*arr->AsFloat(), data);
  // Format 1.0 requires the header (10-byte preamble included) to end on a 64-byte boundary.
  EXPECT_EQ(std::filesystem::file_size(path), 128u + data.size() * 4);
  std::remove(path.c_str());
}

TEST(Npy, RejectsGarbageWithAMessage) {
  const std::string path = TempPath("bad.npy");
  std::ofstream(path) << "definitely not numpy";
  auto arr = ReadNpy(path);
  EXPECT_EQ(arr.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(arr.status().message().find(path), std::string::npos);
  std::remove(path.c_str());
  EXPECT_EQ(ReadNpy(TempPath("missing.npy")).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace infinigen
