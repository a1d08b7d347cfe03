// Backend::GatherBlockRows on the CPU (the CUDA kernel's reference): rows found by block table
// as the KV store's own host path finds them (kv_store/row_copy.h HeadRowAddresses), counts per
// sequence, rows past a count untouched; slots, blocks and counts out of range give zero rows
// and are counted, never read or written out of bounds; shapes that do not fit are refused.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gpu_worker/backend/cpu_backend.h"
#include "kv_store/row_copy.h"

namespace infinigen {
namespace {

constexpr int64_t kRowBytes = 24, kRowsPerBlock = 5;
constexpr size_t kBlockBytes = 128;  // more than 5 x 24: the arena's blocks may be padded
constexpr int kBatch = 3, kHeads = 2;
constexpr int64_t kTable = 4;
// Three different sizes, so that a stride taken for another fails: rows gathered at most, slots
// per list, rows per list of dst.
constexpr int64_t kMax = 7, kSlots = 9, kDstRows = 8;

struct Fixture {
  std::vector<uint8_t> arena;
  std::vector<int32_t> tables, slots, counts;
  std::vector<uint8_t> dst;
  int32_t errors = 0;

  explicit Fixture(uint32_t seed) {
    std::mt19937 rng(seed);
    const int64_t blocks = kBatch * kHeads * kTable;
    arena.resize(static_cast<size_t>(blocks) * kBlockBytes);
    for (uint8_t& byte : arena) byte = static_cast<uint8_t>(rng());
    tables.resize(static_cast<size_t>(blocks));
    std::iota(tables.begin(), tables.end(), 0);
    std::shuffle(tables.begin(), tables.end(), rng);  // each list's blocks anywhere in the arena
    slots.resize(static_cast<size_t>(kBatch * kHeads * kSlots));
    std::uniform_int_distribution<int32_t> slot(0, kTable * kRowsPerBlock - 1);
    for (int32_t& s : slots) s = slot(rng);
    counts = {kMax, 3, -5};  // full, short, negative (nothing)
    dst.assign(static_cast<size_t>(kBatch * kHeads * kDstRows * kRowBytes), 0xab);
  }

  BlockRowsGather Request() {
    BlockRowsGather g;
    g.arena = arena.data();
    g.arena_bytes = arena.size();
    g.block_bytes = kBlockBytes;
    g.rows_per_block = kRowsPerBlock;
    g.row_bytes = kRowBytes;
    g.batch = kBatch;
    g.num_kv_heads = kHeads;
    g.tables = tables.data();
    g.table_capacity = kTable;
    g.slots = slots.data();
    g.slot_capacity = kSlots;
    g.counts = counts.data();
    g.max_count = kMax;
    g.errors = &errors;
    g.dst = dst.data();
    g.dst_rows_per_list = kDstRows;
    return g;
  }

  const uint8_t* Out(int64_t list, int64_t j) const {
    return dst.data() + (list * kDstRows + j) * kRowBytes;
  }
};

TEST(GatherBlockRows, FindsEachRowWhereTheStoresHostPathDoes) {
  Fixture f(1);
  CpuBackend cpu;
  ASSERT_TRUE(cpu.GatherBlockRows(f.Request()).ok());
  EXPECT_EQ(f.errors, 0);
  for (int b = 0; b < kBatch; ++b) {
    for (int h = 0; h < kHeads; ++h) {
      const int64_t list = int64_t{b} * kHeads + h;
      // The store's view of this list (its K blocks; V is another table of the same layout).
      const HeadRowsView view{f.arena.data(),
                              kBlockBytes,
                              f.tables.data() + list * kTable,
                              f.tables.data() + list * kTable,
                              kRowBytes,
                              kRowsPerBlock};
      std::vector<const void*> k(kMax), v(kMax);
      HeadRowAddresses(view, f.slots.data() + list * kSlots, kMax, k.data(), v.data());
      for (int64_t j = 0; j < kDstRows; ++j) {
        if (j < f.counts[b]) {  // (j < kMax)
          EXPECT_EQ(std::memcmp(f.Out(list, j), k[j], kRowBytes), 0) << list << "," << j;
        } else {  // past the sequence's count: as it was
          EXPECT_EQ(f.Out(list, j)[0], 0xab) << list << "," << j;
          EXPECT_EQ(f.Out(list, j)[kRowBytes - 1], 0xab) << list << "," << j;
        }
      }
    }
  }
}

TEST(GatherBlockRows, RowsOutOfRangeAreZerosAndCounted) {
  Fixture f(2);
  f.counts = {kMax, kMax + 5, 2};           // sequence 1's count above the bound: one error
  f.slots[0] = -1;                          // list 0: a negative slot
  f.slots[1] = kTable * kRowsPerBlock;      // past the table
  f.tables[2 * kTable + 1] = -3;            // list 2 (sequence 1), block 1: no block
  f.tables[3 * kTable + 0] = 1 << 20;       // list 3, block 0: past the arena
  f.slots[2 * kSlots + 0] = kRowsPerBlock;  // list 2 row 0 in block 1
  f.slots[3 * kSlots + 0] = 0;              // list 3 row 0 in block 0
  int expected = 1 + 4;
  for (int64_t j = 1; j < kMax; ++j) {  // other rows that also land in the bad blocks
    if (f.slots[2 * kSlots + j] / kRowsPerBlock == 1) ++expected;
    if (f.slots[3 * kSlots + j] / kRowsPerBlock == 0) ++expected;
  }
  CpuBackend cpu;
  ASSERT_TRUE(cpu.GatherBlockRows(f.Request()).ok());
  EXPECT_EQ(f.errors, expected);
  const std::vector<uint8_t> zeros(kRowBytes, 0);
  for (auto [list, j] : {std::pair{0, 0}, std::pair{0, 1}, std::pair{2, 0}, std::pair{3, 0}}) {
    EXPECT_EQ(std::memcmp(f.Out(list, j), zeros.data(), kRowBytes), 0) << list << "," << j;
  }
  // Sequence 1 was taken at max_count rows, every one written (zeros in the bad blocks, the
  // arena's row elsewhere), and dst's row past them left as it was.
  for (int64_t list : {2, 3}) {
    const int64_t bad_block = list == 2 ? 1 : 0;
    for (int64_t j = 0; j < kMax; ++j) {
      const int32_t slot = f.slots[list * kSlots + j];
      const uint8_t* want = zeros.data();
      if (slot / kRowsPerBlock != bad_block) {
        want = f.arena.data() + f.tables[list * kTable + slot / kRowsPerBlock] * kBlockBytes +
               (slot % kRowsPerBlock) * kRowBytes;
      }
      EXPECT_EQ(std::memcmp(f.Out(list, j), want, kRowBytes), 0) << list << "," << j;
    }
    EXPECT_EQ(f.Out(list, kMax)[0], 0xab);
  }
}

// With dst_rows, row j of a list lands at the row it names (a reversed order here, and one
// list naming rows outside its dst: those are counted and nothing is written for them).
TEST(GatherBlockRows, DstRowsPlaceEachRowWhereTheyName) {
  Fixture f(3);
  f.counts = {kMax, kMax, kMax};
  std::vector<int32_t> rows(f.slots.size(), 0);
  for (int64_t list = 0; list < kBatch * kHeads; ++list) {
    for (int64_t j = 0; j < kSlots; ++j) {
      rows[list * kSlots + j] = static_cast<int32_t>(kDstRows - 1 - j);
    }
  }
  rows[4 * kSlots + 2] = kDstRows;  // list 4: past its rows
  rows[4 * kSlots + 3] = -1;        // and before them
  BlockRowsGather g = f.Request();
  g.dst_rows = rows.data();
  CpuBackend cpu;
  ASSERT_TRUE(cpu.GatherBlockRows(g).ok());
  EXPECT_EQ(f.errors, 2);
  for (int64_t list = 0; list < kBatch * kHeads; ++list) {
    for (int64_t j = 0; j < kMax; ++j) {
      const int32_t slot = f.slots[list * kSlots + j];
      const uint8_t* want = f.arena.data() +
                            f.tables[list * kTable + slot / kRowsPerBlock] * kBlockBytes +
                            (slot % kRowsPerBlock) * kRowBytes;
      if (list == 4 && (j == 2 || j == 3)) continue;
      EXPECT_EQ(std::memcmp(f.Out(list, kDstRows - 1 - j), want, kRowBytes), 0) << list << "," << j;
    }
    // Row 0 is nobody's (kMax of kDstRows rows are named); list 4's rows 5 and 4 were skipped.
    EXPECT_EQ(f.Out(list, 0)[0], 0xab) << list;
  }
  EXPECT_EQ(f.Out(4, kDstRows - 1 - 2)[0], 0xab);
  EXPECT_EQ(f.Out(4, kDstRows - 1 - 3)[0], 0xab);
}

TEST(GatherBlockRows, ShapesThatDoNotFitAreRefused) {
  Fixture f(3);
  CpuBackend cpu;
  auto refused = [&](auto mutate) {
    BlockRowsGather g = f.Request();
    mutate(g);
    return cpu.GatherBlockRows(g).code() == absl::StatusCode::kInvalidArgument;
  };
  EXPECT_TRUE(refused([](BlockRowsGather& g) { g.block_bytes = kRowsPerBlock * kRowBytes - 2; }));
  EXPECT_TRUE(refused([&](BlockRowsGather& g) { g.block_bytes = f.arena.size() + 2; }));
  EXPECT_TRUE(refused([](BlockRowsGather& g) { g.row_bytes = kRowBytes - 1; }));  // odd
  EXPECT_TRUE(refused([](BlockRowsGather& g) { g.dst = static_cast<uint8_t*>(g.dst) + 1; }));
  EXPECT_TRUE(refused([](BlockRowsGather& g) { g.slot_capacity = kMax - 1; }));
  EXPECT_TRUE(refused([](BlockRowsGather& g) { g.dst_rows_per_list = kMax - 1; }));
  EXPECT_TRUE(refused([](BlockRowsGather& g) { g.rows_per_block = 0; }));
  EXPECT_TRUE(refused([](BlockRowsGather& g) { g.rows_per_block = int64_t{1} << 62; }));
  EXPECT_TRUE(refused([](BlockRowsGather& g) { g.num_kv_heads = 0; }));
  EXPECT_TRUE(refused([](BlockRowsGather& g) { g.batch = 70000; }));
  EXPECT_TRUE(refused([](BlockRowsGather& g) { g.tables = nullptr; }));
  EXPECT_TRUE(refused([](BlockRowsGather& g) { g.max_count = -1; }));
  BlockRowsGather none = f.Request();
  none.batch = 0;
  none.tables = nullptr;  // nothing to gather: nothing is read
  EXPECT_TRUE(cpu.GatherBlockRows(none).ok());
  EXPECT_EQ(f.errors, 0);
}

}  // namespace
}  // namespace infinigen
