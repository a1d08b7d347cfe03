// ReusedRows against a plainly simulated device buffer: after each Place the caller moves the
// misses into the rows it names, and then every listed slot's row must hold that slot (never a
// row another listed slot holds), only the misses move, and a row held from an earlier list is
// moved again only if it was forgotten. Random lists over many steps, with the overlap of
// consecutive decode steps, forgotten layers and lists that do not fit.
#include "gpu_worker/kv/row_reuse.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <vector>

#include "tests/support/slot_lists.h"

namespace infinigen {
namespace {

constexpr int kLayers = 3, kHeads = 2;
constexpr int64_t kRows = 40;

using testing::NextList;

TEST(ReusedRows, EveryListedSlotIsFoundWhereThePlanSaysAndOnlyMissesMove) {
  ReusedRows reuse(kLayers, kHeads, kRows);
  // The simulated device buffer: the slot each row holds (-1: nothing yet).
  std::vector<int32_t> buffer(kLayers * kHeads * kRows, -1);
  std::vector<std::vector<int32_t>> last(kLayers * kHeads);
  ReusedRows::Plan plan;
  std::mt19937 rng(7);
  int64_t hits = 0, listed = 0;
  for (int step = 0; step < 300; ++step) {
    const int layer = step % kLayers;
    const int64_t stored = 50 + step;
    const int64_t count = 1 + static_cast<int64_t>(rng() % kRows);
    std::vector<int32_t> slots;
    for (int g = 0; g < kHeads; ++g) {
      std::vector<int32_t>& l = last[layer * kHeads + g];
      l = NextList(l, count, stored, 0.8, rng);
      slots.insert(slots.end(), l.begin(), l.end());
    }
    if (step % 37 == 36) {  // a move that did not happen: the layer's rows are unknown
      reuse.Forget(layer);
      for (int g = 0; g < kHeads; ++g) {
        for (int64_t r = 0; r < kRows; ++r) buffer[(layer * kHeads + g) * kRows + r] = -2;
      }
    }
    ASSERT_TRUE(reuse.Place(layer, slots.data(), count, plan)) << step;
    ASSERT_EQ(plan.count, count);
    int64_t misses = 0;
    for (int g = 0; g < kHeads; ++g) {
      const int32_t n = plan.miss_counts(kHeads)[g];
      ASSERT_GE(n, 0);
      ASSERT_LE(n, plan.most_misses);
      misses += n;
      for (int32_t m = 0; m < n; ++m) {
        const int32_t row = plan.miss_rows(kHeads)[g * count + m];
        ASSERT_GE(row, 0);
        ASSERT_LT(row, kRows);
        buffer[(layer * kHeads + g) * kRows + row] = plan.miss_slots()[g * count + m];
      }
    }
    ASSERT_EQ(misses, plan.misses);
    for (int g = 0; g < kHeads; ++g) {
      std::set<int32_t> rows;
      for (int64_t j = 0; j < count; ++j) {
        const int32_t row = plan.positions[g * count + j];
        ASSERT_GE(row, 0);
        ASSERT_LT(row, kRows);
        EXPECT_TRUE(rows.insert(row).second) << "two slots in one row, step " << step;
        EXPECT_EQ(buffer[(layer * kHeads + g) * kRows + row], slots[g * count + j])
            << "step " << step << " head " << g << " j " << j;
      }
    }
    hits += kHeads * count - misses;
    listed += kHeads * count;
  }
  // Lists sharing about 80% of the last one's slots of the layer find most rows held.
  EXPECT_GT(static_cast<double>(hits) / static_cast<double>(listed), 0.5);
}

TEST(ReusedRows, ListsThatDoNotFitChangeNothing) {
  ReusedRows reuse(kLayers, kHeads, kRows);
  ReusedRows::Plan plan;
  std::vector<int32_t> slots = {1, 5, 9, 2, 3, 4};
  ASSERT_TRUE(reuse.Place(0, slots.data(), 3, plan));
  EXPECT_EQ(plan.misses, 6);
  std::vector<int32_t> unordered = {1, 9, 5, 2, 3, 4};
  EXPECT_FALSE(reuse.Place(0, unordered.data(), 3, plan));
  std::vector<int32_t> repeated = {1, 5, 5, 2, 3, 4};
  EXPECT_FALSE(reuse.Place(0, repeated.data(), 3, plan));
  std::vector<int32_t> negative = {-1, 5, 9, 2, 3, 4};
  EXPECT_FALSE(reuse.Place(0, negative.data(), 3, plan));
  std::vector<int32_t> too_many(2 * (kRows + 1));
  for (int64_t j = 0; j < 2 * (kRows + 1); ++j) too_many[j] = static_cast<int32_t>(j % (kRows + 1));
  EXPECT_FALSE(reuse.Place(0, too_many.data(), kRows + 1, plan));
  EXPECT_FALSE(reuse.Place(kLayers, slots.data(), 3, plan));
  // Still what the first list left: the same list moves nothing.
  ASSERT_TRUE(reuse.Place(0, slots.data(), 3, plan));
  EXPECT_EQ(plan.misses, 0);
  EXPECT_EQ(plan.most_misses, 0);
  // Forgotten: everything moves again.
  reuse.Forget(0);
  ASSERT_TRUE(reuse.Place(0, slots.data(), 3, plan));
  EXPECT_EQ(plan.misses, 6);
}

}  // namespace
}  // namespace infinigen
