// DeviceBlockTables: a sequence's KV-store block tables mirrored in backend memory, as the store
// answers them (kv_store/row_copy.h BlockTableOut): the blocks answered land in the device copy,
// a growth past the opened capacity keeps them and asks only for the blocks not held (also when
// the store had answered more than there was room for), and a released copy is made again
// with what was answered.
#include "gpu_worker/kv/device_block_tables.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "gpu_worker/backend/cpu_backend.h"

namespace infinigen {
namespace {

constexpr int kLayers = 2, kHeads = 2;
constexpr int64_t kRowsPerBlock = 4;

// What the store does for a gather by block table of a layer holding `n` blocks per head:
// head g's K blocks are 100 * g + i, its V blocks 1000 + 100 * g + i.
void Answer(const BlockTableOut& out, int64_t n) {
  for (int g = 0; g < kHeads; ++g) {
    std::vector<int32_t> k(n), v(n);
    for (int64_t i = 0; i < n; ++i) {
      k[i] = static_cast<int32_t>(100 * g + i);
      v[i] = static_cast<int32_t>(1000 + 100 * g + i);
    }
    AnswerHeadBlocks(out, kHeads, g, k.data(), v.data(), n);
  }
  *out.blocks = n;
}

// Layer `layer`'s tables as the device holds them: [2, kHeads, capacity].
std::vector<int32_t> OnDevice(DeviceBlockTables& t, CpuBackend& backend, int layer) {
  auto device = t.OnDevice(backend, layer);
  EXPECT_TRUE(device.ok()) << device.status();
  if (!device.ok()) return {};
  return std::vector<int32_t>(*device, *device + 2 * kHeads * t.capacity());
}

TEST(DeviceBlockTables, HoldWhatTheStoreAnsweredAcrossGrowthAndRelease) {
  CpuBackend backend;
  DeviceBlockTables t(kLayers, kHeads, kRowsPerBlock);
  EXPECT_EQ(t.BlocksFor(8), 2);
  EXPECT_EQ(t.BlocksFor(9), 3);
  EXPECT_EQ(t.BytesFor(8), static_cast<size_t>(kLayers * 2 * kHeads * 2 * 4));
  ASSERT_TRUE(t.Reserve(backend, 8).ok());
  ASSERT_EQ(t.capacity(), 2);

  // The store holds 3 blocks a head of layer 1: the tables hold the first 2.
  BlockTableOut out = t.Out(1);
  EXPECT_EQ(out.known, 0);
  EXPECT_EQ(out.capacity, 2);
  Answer(out, 3);
  EXPECT_EQ(OnDevice(t, backend, 1),
            (std::vector<int32_t>{0, 1, 100, 101, 1000, 1001, 1100, 1101}));
  EXPECT_EQ(t.Out(1).known, 2) << "held: the capacity's blocks, not the store's 3";
  EXPECT_EQ(t.Out(0).known, 0);

  // Past the capacity: room doubles, the held blocks stay, the next answer starts after them.
  ASSERT_TRUE(t.Reserve(backend, 12, /*grow=*/true).ok());
  ASSERT_EQ(t.capacity(), 4);
  out = t.Out(1);
  EXPECT_EQ(out.known, 2);
  EXPECT_EQ(OnDevice(t, backend, 1), (std::vector<int32_t>{0, 1, -1, -1, 100, 101, -1, -1, 1000,
                                                           1001, -1, -1, 1100, 1101, -1, -1}));
  Answer(out, 3);
  const std::vector<int32_t> three = {0,    1,    2,    -1, 100,  101,  102,  -1,
                                      1000, 1001, 1002, -1, 1100, 1101, 1102, -1};
  EXPECT_EQ(OnDevice(t, backend, 1), three);

  // Released (an idle sequence): no device copy; made again, it holds the same.
  t.Release();
  EXPECT_FALSE(t.on_device());
  EXPECT_EQ(t.OnDevice(backend, 1).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(t.Reserve(backend, 12).ok());
  EXPECT_EQ(t.capacity(), 4);
  EXPECT_EQ(OnDevice(t, backend, 1), three);
}

}  // namespace
}  // namespace infinigen
