// The rows a backend keeps between decode steps, planned in its memory (Backend::PlanKeptRows,
// MapKeptRows; the CPU's plain loops, which the CUDA kernels are tested against), checked
// against a plainly simulated buffer and the host's own bookkeeping (ReusedRows): after each
// plan and its moves every listed slot's row holds that slot, only slots not held before move
// (as many as ReusedRows moves), and a choice maps onto the kept rows, the current token's row
// and rows of its own for the slots not kept, whose bytes a block-table gather then brings.
// Also a gather with a count per list, and decode attention over a count in backend memory.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/kv/row_reuse.h"
#include "tests/support/slot_lists.h"

namespace infinigen {
namespace {

constexpr int kHeads = 3;
constexpr int64_t kRows = 40, kSlots = 200, kCapacity = 45;

using testing::NextList;

struct Kept {
  std::vector<int32_t> row_of = std::vector<int32_t>(kHeads * kSlots, -1);
  std::vector<int32_t> slot_of = std::vector<int32_t>(kHeads * kRows, -1);
  KeptRows View() { return {kHeads, row_of.data(), kSlots, slot_of.data(), kRows}; }
};

struct Moves {
  std::vector<int32_t> slots = std::vector<int32_t>(kHeads * kCapacity, -9);
  std::vector<int32_t> rows = std::vector<int32_t>(kHeads * kCapacity, -9);
  std::vector<int32_t> counts = std::vector<int32_t>(kHeads, -9);
  std::vector<int32_t> workspace = std::vector<int32_t>(kHeads * kRows);
};

KeptRowsPlan PlanOf(Kept& kept, const std::vector<int32_t>& list, const int32_t* count, Moves& m,
                    int32_t* errors, bool keep = true) {
  KeptRowsPlan p;
  p.kept = kept.View();
  p.list = {list.data(), count, kCapacity, kCapacity};
  p.keep = keep;
  p.move_slots = m.slots.data();
  p.move_rows = m.rows.data();
  p.move_counts = m.counts.data();
  p.workspace = m.workspace.data();
  p.errors = errors;
  return p;
}

TEST(KeptRows, EveryListedSlotIsWhereTheMapSaysAndOnlyWhatWasNotHeldMoves) {
  CpuBackend cpu;
  Kept kept;
  ReusedRows host(1, kHeads, kRows);  // the host's bookkeeping: the same number of moves
  ReusedRows::Plan host_plan;
  std::vector<int32_t> buffer(kHeads * kRows, -1);  // the slot each simulated row holds
  std::vector<std::vector<int32_t>> last(kHeads), held(kHeads);
  std::mt19937 rng(5);
  int64_t moved = 0, listed = 0;
  for (int step = 0; step < 200; ++step) {
    const int64_t stored = 60 + step / 2;
    const int32_t count = 1 + static_cast<int32_t>(rng() % kRows);
    std::vector<int32_t> list(kHeads * kCapacity, -3);  // past the count: never read
    std::vector<int32_t> host_list;
    for (int g = 0; g < kHeads; ++g) {
      last[g] = NextList(last[g], count, stored, 0.85, rng);
      std::copy(last[g].begin(), last[g].end(), list.begin() + g * kCapacity);
      host_list.insert(host_list.end(), last[g].begin(), last[g].end());
    }
    Moves m;
    int32_t errors = 0;
    std::vector<int32_t> heads_listed(kHeads, -1);
    KeptRowsPlan plan = PlanOf(kept, list, &count, m, &errors);
    plan.listed = heads_listed.data();
    ASSERT_TRUE(cpu.PlanKeptRows(plan).ok());
    ASSERT_EQ(errors, 0) << step;
    EXPECT_EQ(heads_listed, std::vector<int32_t>(kHeads, count));
    ASSERT_TRUE(host.Place(0, host_list.data(), count, host_plan));
    int64_t step_moves = 0;
    for (int g = 0; g < kHeads; ++g) {
      // The moves, as a gather would make them, of slots the last list did not hold.
      const std::set<int32_t> before(held[g].begin(), held[g].end());
      for (int32_t i = 0; i < m.counts[g]; ++i) {
        const int32_t s = m.slots[g * kCapacity + i], r = m.rows[g * kCapacity + i];
        ASSERT_GE(r, 0);
        ASSERT_LT(r, kRows);
        EXPECT_EQ(before.count(s), 0u) << "slot " << s << " was held and moved again";
        buffer[g * kRows + r] = s;
      }
      step_moves += m.counts[g];
      std::set<int32_t> rows;
      for (int32_t j = 0; j < count; ++j) {
        const int32_t s = list[g * kCapacity + j];
        const int32_t r = kept.row_of[g * kSlots + s];
        ASSERT_GE(r, 0) << "step " << step << " head " << g << " slot " << s;
        EXPECT_EQ(buffer[g * kRows + r], s);
        EXPECT_EQ(kept.slot_of[g * kRows + r], s);
        EXPECT_TRUE(rows.insert(r).second) << "two listed slots in row " << r;
      }
      // Nothing else is held.
      int64_t held = 0;
      for (int64_t s = 0; s < kSlots; ++s) held += kept.row_of[g * kSlots + s] >= 0;
      EXPECT_EQ(held, count);
    }
    EXPECT_EQ(step_moves, host_plan.misses) << step;
    held = last;
    moved += step_moves;
    listed += int64_t{kHeads} * count;
  }
  EXPECT_LT(moved, listed / 2);  // the lists overlap: most rows stay
}

TEST(KeptRows, WithoutKeepEveryListedSlotMovesToTheLowestRows) {
  CpuBackend cpu;
  Kept kept;
  std::vector<int32_t> list(kHeads * kCapacity);
  for (int g = 0; g < kHeads; ++g) {
    for (int j = 0; j < kCapacity; ++j) list[g * kCapacity + j] = 3 * j + g;
  }
  const int32_t count = 10;
  for (int pass = 0; pass < 2; ++pass) {  // the same list again still moves every slot
    Moves m;
    int32_t errors = 0;
    ASSERT_TRUE(cpu.PlanKeptRows(PlanOf(kept, list, &count, m, &errors, /*keep=*/false)).ok());
    EXPECT_EQ(errors, 0);
    for (int g = 0; g < kHeads; ++g) {
      ASSERT_EQ(m.counts[g], count);
      for (int j = 0; j < count; ++j) {
        EXPECT_EQ(m.slots[g * kCapacity + j], list[g * kCapacity + j]);
        EXPECT_EQ(m.rows[g * kCapacity + j], j);
      }
    }
  }
  // Every slot, null slots: 0 .. max_count - 1.
  Moves m;
  KeptRowsPlan p = PlanOf(kept, list, nullptr, m, nullptr, /*keep=*/false);
  p.list = {nullptr, nullptr, kCapacity, kRows};
  ASSERT_TRUE(cpu.PlanKeptRows(p).ok());
  for (int g = 0; g < kHeads; ++g) {
    ASSERT_EQ(m.counts[g], kRows);
    for (int j = 0; j < kRows; ++j) EXPECT_EQ(kept.row_of[g * kSlots + j], j);
  }
}

TEST(KeptRows, SlotsOutsideTheMapAndListsThatDoNotFitAreCountedNotWritten) {
  CpuBackend cpu;
  Kept kept;
  std::vector<int32_t> list(kHeads * kCapacity);
  for (int g = 0; g < kHeads; ++g) {
    for (int j = 0; j < kCapacity; ++j) list[g * kCapacity + j] = j;
  }
  list[0] = -4;                     // head 0: below the map
  list[kCapacity + 44] = kSlots;    // head 1: past it
  const int32_t count = kCapacity;  // 45 listed, 40 rows: 5 do not fit per head
  Moves m;
  int32_t errors = 0;
  ASSERT_TRUE(cpu.PlanKeptRows(PlanOf(kept, list, &count, m, &errors)).ok());
  EXPECT_EQ(errors, 2 + (5 - 1) + (5 - 1) + 5);
  for (int g = 0; g < kHeads; ++g) EXPECT_EQ(m.counts[g], kRows);
  // A count above max_count is taken as max_count (once counted).
  const int32_t too_many = kCapacity + 1;
  errors = 0;
  Kept fresh;
  ASSERT_TRUE(cpu.PlanKeptRows(PlanOf(fresh, list, &too_many, m, &errors)).ok());
  EXPECT_EQ(errors, 1 + 2 + 4 + 4 + 5);
  // Shapes that do not fit.
  KeptRowsPlan p = PlanOf(kept, list, &count, m, &errors);
  p.list.capacity = kCapacity - 1;
  EXPECT_TRUE(absl::IsInvalidArgument(cpu.PlanKeptRows(p)));
  p = PlanOf(kept, list, &count, m, &errors);
  p.workspace = nullptr;
  EXPECT_TRUE(absl::IsInvalidArgument(cpu.PlanKeptRows(p)));
}

// A store-like arena: slot s of list l at block tables[l][s / 4], row s % 4; each row's bytes say
// which (list, slot) it is.
constexpr int64_t kRowBytes = 8, kPerBlock = 4;
struct Arena {
  std::vector<uint8_t> bytes;
  std::vector<int32_t> tables;
  int64_t table_capacity = kSlots / kPerBlock + 1;
  explicit Arena(std::mt19937& rng) {
    const int64_t blocks = kHeads * table_capacity;
    bytes.resize(static_cast<size_t>(blocks * kPerBlock * kRowBytes));
    tables.resize(static_cast<size_t>(blocks));
    std::iota(tables.begin(), tables.end(), 0);
    std::shuffle(tables.begin(), tables.end(), rng);
    for (int64_t l = 0; l < kHeads; ++l) {
      for (int64_t s = 0; s < table_capacity * kPerBlock; ++s) {
        const int32_t id[2] = {static_cast<int32_t>(l), static_cast<int32_t>(s)};
        std::memcpy(Row(l, s), id, sizeof(id));
      }
    }
  }
  uint8_t* Row(int64_t l, int64_t s) {
    return bytes.data() +
           (tables[l * table_capacity + s / kPerBlock] * kPerBlock + s % kPerBlock) * kRowBytes;
  }
  BlockRowsGather Gather() {
    BlockRowsGather g;
    g.arena = bytes.data();
    g.arena_bytes = bytes.size();
    g.block_bytes = kPerBlock * kRowBytes;
    g.rows_per_block = kPerBlock;
    g.row_bytes = kRowBytes;
    g.batch = 1;
    g.num_kv_heads = kHeads;
    g.tables = tables.data();
    g.table_capacity = table_capacity;
    return g;
  }
};

TEST(KeptRows, AChoiceMapsOntoKeptRowsTheCurrentRowAndItsMissesWhichAGatherBrings) {
  CpuBackend cpu;
  std::mt19937 rng(9);
  Arena arena(rng);
  Kept kept;
  // The staging rows, as a decode step's: head g's kRows kept rows, then one current row per
  // head, then kMiss rows of misses per head.
  constexpr int64_t kMiss = 6;
  const int64_t current_row = kHeads * kRows, miss_row = current_row + kHeads;
  std::vector<uint8_t> staging(static_cast<size_t>((miss_row + kHeads * kMiss) * kRowBytes));
  std::vector<std::vector<int32_t>> last(kHeads);
  for (int step = 0; step < 50; ++step) {
    const int32_t stored = 100 + step;  // the current token is slot `stored`
    const int32_t count = 20 + static_cast<int32_t>(rng() % 21);
    std::vector<int32_t> list(kHeads * kCapacity);
    for (int g = 0; g < kHeads; ++g) {
      last[g] = NextList(last[g], count, stored, 0.8, rng);
      std::copy(last[g].begin(), last[g].end(), list.begin() + g * kCapacity);
    }
    Moves m;
    int32_t errors = 0;
    ASSERT_TRUE(cpu.PlanKeptRows(PlanOf(kept, list, &count, m, &errors)).ok());
    BlockRowsGather g = arena.Gather();
    g.slots = m.slots.data();
    g.slot_capacity = kCapacity;
    g.list_counts = m.counts.data();
    g.max_count = kRows;  // no head moves more than its rows
    g.dst = staging.data();
    g.dst_rows_per_list = kRows;
    g.dst_rows = m.rows.data();
    g.errors = &errors;
    ASSERT_TRUE(cpu.GatherBlockRows(g).ok());
    // The current token's rows, as the step writes them.
    for (int h = 0; h < kHeads; ++h) {
      const int32_t id[2] = {h, stored};
      std::memcpy(staging.data() + (current_row + h) * kRowBytes, id, sizeof(id));
    }
    // The choice: part of the list, the current token, and (some steps) slots never listed.
    const int32_t chosen = 1 + static_cast<int32_t>(rng() % count) + 1;
    std::vector<int32_t> choice(kHeads * kCapacity, -1);
    int32_t misses_wanted = step % 3 == 0 ? 0 : static_cast<int32_t>(rng() % (kMiss + 1));
    for (int h = 0; h < kHeads; ++h) {
      std::set<int32_t> c;
      for (int32_t j = 0; j < count && static_cast<int32_t>(c.size()) < chosen - 1; ++j) {
        if (rng() % 2) c.insert(list[h * kCapacity + j]);
      }
      for (int32_t s = stored - 1, n = 0; s >= 0 && n < misses_wanted; --s) {
        if (kept.row_of[h * kSlots + s] < 0 && c.insert(s).second) ++n;
      }
      c.insert(stored);
      std::copy(c.begin(), c.end(), choice.begin() + h * kCapacity);
    }
    // One count for every head (InfiniGen's k per sequence): the smallest list's.
    int32_t choice_count = kCapacity;
    for (int h = 0; h < kHeads; ++h) {
      int32_t n = 0;
      while (n < kCapacity && choice[h * kCapacity + n] >= 0) ++n;
      choice_count = std::min(choice_count, n);
    }
    std::vector<int32_t> out(kHeads * kCapacity, -5), miss_slots(kHeads * kCapacity, -5),
        miss_counts(kHeads, -5);
    KeptRowsMap map;
    map.kept = kept.View();
    map.list = {choice.data(), &choice_count, kCapacity, kCapacity};
    map.head_rows = kRows;
    map.current_slot = stored;
    map.current_row = current_row;
    map.miss_row = miss_row;
    map.miss_capacity = kMiss;
    map.out = out.data();
    map.miss_slots = miss_slots.data();
    map.miss_counts = miss_counts.data();
    map.errors = &errors;
    ASSERT_TRUE(cpu.MapKeptRows(map).ok());
    BlockRowsGather mg = arena.Gather();
    mg.slots = miss_slots.data();
    mg.slot_capacity = kCapacity;
    mg.list_counts = miss_counts.data();
    mg.max_count = kMiss;
    mg.dst = staging.data() + miss_row * kRowBytes;
    mg.dst_rows_per_list = kMiss;
    mg.errors = &errors;
    ASSERT_TRUE(cpu.GatherBlockRows(mg).ok());
    ASSERT_EQ(errors, 0) << step;
    // Attention's view: row out[j] of head h, counted from head h's first row.
    for (int h = 0; h < kHeads; ++h) {
      for (int32_t j = 0; j < choice_count; ++j) {
        const int32_t s = choice[h * kCapacity + j];
        int32_t id[2];
        std::memcpy(id, staging.data() + (h * kRows + out[h * kCapacity + j]) * kRowBytes,
                    sizeof(id));
        EXPECT_EQ(id[0], h) << "step " << step << " slot " << s;
        EXPECT_EQ(id[1], s) << "step " << step << " head " << h;
      }
    }
  }
}

TEST(KeptRows, MissesPastTheirRoomAreCountedAndReadTheCurrentRow) {
  CpuBackend cpu;
  Kept kept;
  std::vector<int32_t> choice(kHeads * kCapacity);
  for (int h = 0; h < kHeads; ++h) {
    for (int j = 0; j < kCapacity; ++j) choice[h * kCapacity + j] = j;
  }
  const int32_t count = 5;
  std::vector<int32_t> out(kHeads * kCapacity), miss_slots(kHeads * kCapacity), miss_counts(kHeads);
  int32_t errors = 0;
  KeptRowsMap map;
  map.kept = kept.View();
  map.list = {choice.data(), &count, kCapacity, kCapacity};
  map.head_rows = kRows;
  map.current_slot = 1000;
  map.current_row = kHeads * kRows;
  map.miss_row = kHeads * kRows + kHeads;
  map.miss_capacity = 3;
  map.out = out.data();
  map.miss_slots = miss_slots.data();
  map.miss_counts = miss_counts.data();
  map.errors = &errors;
  ASSERT_TRUE(cpu.MapKeptRows(map).ok());
  EXPECT_EQ(errors, kHeads * 2);
  for (int h = 0; h < kHeads; ++h) {
    EXPECT_EQ(miss_counts[h], 3);
    EXPECT_EQ(out[h * kCapacity + 4], kHeads * kRows + h - h * kRows);
  }
  map.miss_row = int64_t{1} << 31;
  EXPECT_TRUE(absl::IsInvalidArgument(cpu.MapKeptRows(map)));
}

TEST(KeptRows, DecodeAttentionOverACountInBackendMemoryIsThePackedListsAttention) {
  CpuBackend cpu;
  constexpr int kQHeads = 6, kDim = 8;
  constexpr int64_t kStored = 30, kListRows = 12;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> q(kQHeads * kDim), k(kHeads * kStored * kDim), v(k.size());
  for (float& x : q) x = normal(rng);
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  std::vector<int32_t> lists(kHeads * kListRows);
  for (int32_t& r : lists) r = static_cast<int32_t>(rng() % kStored);
  const AttentionShape shape{kQHeads, kHeads, kDim, 0.3f};
  const KvView kk{k.data(), DType::kF32, kStored * kDim, kDim};
  const KvView vv{v.data(), DType::kF32, kStored * kDim, kDim};
  for (int32_t n : {7, 12, 0, 40}) {
    SCOPED_TRACE(n);
    const int64_t rows = std::clamp<int64_t>(n, 0, kListRows);
    std::vector<int32_t> packed;
    for (int h = 0; h < kHeads; ++h) {
      packed.insert(packed.end(), lists.begin() + h * kListRows,
                    lists.begin() + h * kListRows + rows);
    }
    std::vector<float> want(kQHeads * kDim, -1), got(kQHeads * kDim, -2);
    const MatView qv{q.data(), DType::kF32, 1, kQHeads * kDim, kQHeads * kDim};
    ASSERT_TRUE(cpu.AttentionDecode(qv, kk, vv, packed.data(), rows, shape,
                                    {want.data(), DType::kF32, 1, kQHeads * kDim, kQHeads * kDim})
                    .ok());
    DecodeAttentionItem item{
        qv,        kk,
        vv,        lists.data(),
        kListRows, {got.data(), DType::kF32, 1, kQHeads * kDim, kQHeads * kDim},
        &n};
    ASSERT_TRUE(cpu.AttentionDecodeBatch({&item, 1}, shape).ok());
    EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)));
  }
}

}  // namespace
}  // namespace infinigen
