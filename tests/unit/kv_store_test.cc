// The KV store library: rows in, the same rows out by index; errors for bad requests; a full
// store refuses without touching anyone's data; the KV pool evicts by its policy; leases free
// the sequences of owners that stopped renewing; concurrent use.
#include "kv_store/kv_store.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <thread>

#include "kv_store/row_copy.h"
#include "kv_store/ucx/ucx_wire.h"

namespace infinigen {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1000);

std::unique_ptr<KvStore> MakeStore(size_t capacity = 8 << 20, int64_t parallel_bytes = 1 << 20) {
  KvStoreConfig c;
  c.capacity_bytes = capacity;
  c.block_tokens = 16;
  c.max_row_bytes = 256;
  c.parallel_gather_bytes = parallel_bytes;
  c.huge_pages = false;
  auto s = KvStore::Create(c);
  EXPECT_TRUE(s.ok()) << s.status();
  return std::move(*s);
}

SequenceSpec Spec(int layers = 2, int heads = 3, int dim = 24, DType dtype = DType::kBF16) {
  SequenceSpec s;
  s.num_layers = layers;
  s.num_kv_heads = heads;
  s.head_dim = dim;
  s.dtype = dtype;
  s.owner = "worker-a";
  return s;
}

// Deterministic row bytes: token t, head g, K or V.
std::vector<uint8_t> Rows(const SequenceSpec& s, int64_t start, int64_t n, uint8_t kv,
                          uint64_t salt = 0) {
  const int64_t token_bytes = s.num_kv_heads * s.row_bytes();
  std::vector<uint8_t> out(n * token_bytes);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < token_bytes; ++i) {
      out[t * token_bytes + i] =
          static_cast<uint8_t>(((start + t) * 131 + i * 7 + kv * 29 + salt * 17) % 251);
    }
  }
  return out;
}

void AppendRows(KvStore& store, StoreSequenceId seq, const SequenceSpec& s, int layer,
                int64_t start, int64_t n, uint64_t salt = 0) {
  auto k = Rows(s, start, n, 0, salt), v = Rows(s, start, n, 1, salt);
  ASSERT_TRUE(store.Append(seq, layer, start, n, k.data(), v.data(), k.size()).ok());
}

// The bytes of token `t`, head `g` as appended.
std::vector<uint8_t> Expected(const SequenceSpec& s, int64_t t, int g, uint8_t kv,
                              uint64_t salt = 0) {
  auto rows = Rows(s, t, 1, kv, salt);
  return std::vector<uint8_t>(rows.begin() + g * s.row_bytes(),
                              rows.begin() + (g + 1) * s.row_bytes());
}

void ExpectGathered(KvStore& store, StoreSequenceId seq, const SequenceSpec& s, int layer,
                    const std::vector<int32_t>& slots, int64_t count, uint64_t salt = 0) {
  std::vector<uint8_t> k(slots.size() * s.row_bytes()), v(k.size());
  GatherItem item{seq, layer, count, slots, k.data(), v.data()};
  ASSERT_TRUE(store.Gather({&item, 1}).ok());
  for (int g = 0; g < s.num_kv_heads; ++g) {
    for (int64_t j = 0; j < count; ++j) {
      const int32_t t = slots[g * count + j];
      const size_t off = (g * count + j) * s.row_bytes();
      ASSERT_EQ(std::vector<uint8_t>(k.begin() + off, k.begin() + off + s.row_bytes()),
                Expected(s, t, g, 0, salt))
          << "token " << t << " head " << g;
      ASSERT_EQ(std::vector<uint8_t>(v.begin() + off, v.begin() + off + s.row_bytes()),
                Expected(s, t, g, 1, salt));
    }
  }
}

TEST(KvStore, GathersTheRowsItStored) {
  for (int64_t parallel : {int64_t{1} << 30, int64_t{1}}) {  // serial, then thread pool
    auto store = MakeStore(8 << 20, parallel);
    for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
      const SequenceSpec s = Spec(2, 3, 24, dtype);
      const StoreSequenceId seq = static_cast<StoreSequenceId>(dtype) + 10;
      ASSERT_TRUE(store->Open(seq, s, kT0).ok());
      AppendRows(*store, seq, s, 0, 0, 40);  // prefill, spans 3 blocks of 16 rows
      for (int64_t t = 40; t < 45; ++t) AppendRows(*store, seq, s, 0, t, 1);  // decode
      std::mt19937 rng(1);
      std::vector<int32_t> slots(3 * 7);
      for (auto& x : slots) x = static_cast<int32_t>(rng() % 45);
      ExpectGathered(*store, seq, s, 0, slots, 7);
    }
  }
}

TEST(KvStore, OneGatherServesManySequences) {
  auto store = MakeStore(8 << 20, 1);
  const SequenceSpec s = Spec();
  std::vector<std::vector<uint8_t>> k(4), v(4);
  std::vector<std::vector<int32_t>> slots(4);
  std::vector<GatherItem> items;
  for (StoreSequenceId seq = 1; seq <= 4; ++seq) {
    ASSERT_TRUE(store->Open(seq, s, kT0).ok());
    AppendRows(*store, seq, s, 1, 0, 20, seq);
    slots[seq - 1] = {0, 19, 5, 1, 2, 3, 7, 7, 8};
    k[seq - 1].resize(9 * s.row_bytes());
    v[seq - 1].resize(9 * s.row_bytes());
    items.push_back({seq, 1, 3, slots[seq - 1], k[seq - 1].data(), v[seq - 1].data()});
  }
  ASSERT_TRUE(store->Gather(items).ok());
  for (StoreSequenceId seq = 1; seq <= 4; ++seq) {
    EXPECT_EQ(std::vector<uint8_t>(k[seq - 1].begin(), k[seq - 1].begin() + s.row_bytes()),
              Expected(s, 0, 0, 0, seq));
  }
  EXPECT_EQ(store->Stats().gathers, 1);
}

// The copy loop every gather runs (and the address loop of gathers in place), on its own: rows of
// the sizes it specializes (128, 256, 512 bytes) and others, blocks holding a power of two rows or
// not, blocks in any order, slots in random order with runs of consecutive slots that cross block
// boundaries, and counts below and above its prefetch distance; each row must equal a plain per-row
// copy.
TEST(RowCopy, EveryRowSizeAndBlockShapeCopiesTheSelectedRows) {
  std::mt19937 rng(5);
  for (int64_t row_bytes : {32, 96, 128, 256, 384, 512, 1024}) {
    for (int64_t per_block : {16, 24, 64}) {
      constexpr int kBlocks = 9;
      const int64_t rows = kBlocks * per_block;
      const size_t block_bytes = static_cast<size_t>(per_block * row_bytes) + 64;  // padded
      std::vector<uint8_t> arena(2 * kBlocks * block_bytes);
      for (size_t i = 0; i < arena.size(); ++i) arena[i] = static_cast<uint8_t>(rng());
      std::vector<int32_t> blocks(2 * kBlocks);  // K then V, shuffled across the arena
      for (int i = 0; i < 2 * kBlocks; ++i) blocks[i] = i;
      std::shuffle(blocks.begin(), blocks.end(), rng);
      const HeadRowsView view{arena.data(), block_bytes, blocks.data(), blocks.data() + kBlocks,
                              row_bytes,    per_block};
      auto row = [&](const int32_t* b, int64_t slot) {
        return arena.data() + b[slot / per_block] * block_bytes + (slot % per_block) * row_bytes;
      };
      for (int64_t count : {0, 1, 5, 9, 50, 300}) {
        std::vector<int32_t> slots;
        while (static_cast<int64_t>(slots.size()) < count) {
          const int64_t first = rng() % rows, run = 1 + rng() % 4 * (rng() % 3 == 0 ? 10 : 1);
          for (int64_t r = 0;
               r < run && first + r < rows && static_cast<int64_t>(slots.size()) < count; ++r) {
            slots.push_back(static_cast<int32_t>(first + r));
          }
        }
        std::vector<uint8_t> k(count * row_bytes, 0xee), v(count * row_bytes, 0xee);
        CopyHeadRows(view, slots.data(), count, k.data(), v.data());
        std::vector<const void*> k_rows(count), v_rows(count);
        HeadRowAddresses(view, slots.data(), count, k_rows.data(), v_rows.data());
        for (int64_t j = 0; j < count; ++j) {
          ASSERT_EQ(std::memcmp(k.data() + j * row_bytes, row(view.k_blocks, slots[j]), row_bytes),
                    0)
              << "K row " << j << " (slot " << slots[j] << "), rows of " << row_bytes << " bytes, "
              << per_block << " per block";
          ASSERT_EQ(std::memcmp(v.data() + j * row_bytes, row(view.v_blocks, slots[j]), row_bytes),
                    0)
              << "V row " << j << " (slot " << slots[j] << ")";
          ASSERT_EQ(k_rows[j], row(view.k_blocks, slots[j])) << "K address " << j;
          ASSERT_EQ(v_rows[j], row(view.v_blocks, slots[j])) << "V address " << j;
        }
      }
    }
  }
}

// The UCX request's bytes: what a worker writes parses back; a request cut short, one with
// bytes left over, or one announcing more items or indices than it holds is refused without
// sizing anything from the announced numbers (2^32 - 1 items, 2^62 indices).
TEST(GatherWire, RoundTripsAndRefusesMalformedRequests) {
  std::vector<uint8_t> req;
  PutItemCount(req, 2);
  const std::vector<int32_t> a = {3, 1, 4, 1}, b = {};
  PutGatherItem(req, 7, 1, 2, a);
  PutGatherItem(req, 8, 0, 0, b);
  auto items = ParseGatherRequest(req.data(), req.size());
  ASSERT_TRUE(items.ok()) << items.status();
  ASSERT_EQ(items->size(), 2u);
  EXPECT_EQ((*items)[0].seq, 7u);
  EXPECT_EQ((*items)[0].layer, 1);
  EXPECT_EQ((*items)[0].count, 2);
  EXPECT_EQ((*items)[0].slots, a);
  EXPECT_EQ((*items)[1].seq, 8u);
  EXPECT_TRUE((*items)[1].slots.empty());
  for (size_t cut = 0; cut < req.size(); ++cut) {
    EXPECT_EQ(ParseGatherRequest(req.data(), cut).status().code(),
              absl::StatusCode::kInvalidArgument)
        << cut << " bytes";
  }
  std::vector<uint8_t> longer = req;
  longer.push_back(0);
  EXPECT_EQ(ParseGatherRequest(longer.data(), longer.size()).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t> many;
  PutItemCount(many, 0xffffffffu);
  PutGatherItem(many, 1, 0, 1, a);
  EXPECT_EQ(ParseGatherRequest(many.data(), many.size()).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t> indices;
  PutItemCount(indices, 1);
  PutGatherItem(indices, 1, 0, 1, a);
  const int64_t announced = int64_t{1} << 62;  // x 4 bytes wraps to 0
  std::memcpy(indices.data() + 4 + 8 + 4 + 8, &announced, sizeof(announced));
  EXPECT_EQ(ParseGatherRequest(indices.data(), indices.size()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(KvStore, AHeadRangeGathersThoseHeadsOnly) {
  auto store = MakeStore();
  const SequenceSpec s = Spec(1, 3, 24);
  ASSERT_TRUE(store->Open(1, s, kT0).ok());
  AppendRows(*store, 1, s, 0, 0, 30);
  const std::vector<int32_t> slots = {4, 29, 0, 11};  // heads 1 and 2, two rows each
  std::vector<uint8_t> k(4 * s.row_bytes()), v(k.size());
  GatherItem item{1, 0, 2, slots, k.data(), v.data(), /*head_begin=*/1, /*heads=*/2};
  ASSERT_TRUE(store->Gather({&item, 1}).ok());
  for (int g = 0; g < 2; ++g) {
    for (int j = 0; j < 2; ++j) {
      const size_t off = (g * 2 + j) * s.row_bytes();
      EXPECT_EQ(std::vector<uint8_t>(k.begin() + off, k.begin() + off + s.row_bytes()),
                Expected(s, slots[g * 2 + j], 1 + g, 0));
      EXPECT_EQ(std::vector<uint8_t>(v.begin() + off, v.begin() + off + s.row_bytes()),
                Expected(s, slots[g * 2 + j], 1 + g, 1));
    }
  }
  item.head_begin = 2;  // heads [2, 4) of 3
  const absl::Status st = store->Gather({&item, 1});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("KV heads [2, 4)"), std::string::npos) << st;
}

// Requests come from the network: a count whose product with the heads wraps around to the
// number of indices given must not pass (it would copy 2^62 rows into a buffer of 4), a caller
// that sized its buffers for other rows is refused, and Open refuses shapes the store could
// never hold before sizing anything from them.
TEST(KvStore, CountsThatWouldOverflowAndStaleSizesAreRefused) {
  auto store = MakeStore();
  const SequenceSpec s = Spec(1, 4, 16);  // 4 KV heads of 32-byte rows
  ASSERT_TRUE(store->Open(1, s, kT0).ok());
  AppendRows(*store, 1, s, 0, 0, 3);
  std::vector<int32_t> slots = {0, 1, 2, 0};
  std::vector<uint8_t> k(4 * 32, 0xee), v(4 * 32, 0xee);
  GatherItem wraps{1, 0, (int64_t{1} << 62) + 1, slots, k.data(), v.data()};  // x 4 = 2^64 + 4
  EXPECT_EQ(store->Gather({&wraps, 1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(k, std::vector<uint8_t>(4 * 32, 0xee));
  GatherItem stale{1, 0, 1, slots, k.data(), v.data()};
  stale.row_bytes = 64;  // sized for f32 rows; the sequence holds bf16 ones
  const absl::Status st = store->Gather({&stale, 1});
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_EQ(k, std::vector<uint8_t>(4 * 32, 0xee));
  stale.row_bytes = 32;
  EXPECT_TRUE(store->Gather({&stale, 1}).ok());
  EXPECT_TRUE(CountMatches(3, 4, 12));
  EXPECT_FALSE(CountMatches((int64_t{1} << 62) + 1, 4, 4));
  EXPECT_FALSE(CountMatches(-1, 4, 4));
  EXPECT_TRUE(CountMatches(7, 0, 0));

  SequenceSpec huge = Spec(KvStore::kMaxLayers + 1, 2, 16);
  EXPECT_EQ(store->Open(2, huge, kT0).code(), absl::StatusCode::kInvalidArgument);
  huge = Spec(2, 1 << 30, 16);
  EXPECT_EQ(store->Open(2, huge, kT0).code(), absl::StatusCode::kInvalidArgument);
  SequenceSpec pool = Spec(2, 2, 16);
  pool.capacity_tokens = int64_t{1} << 40;  // slot ids are int32; no arena holds this
  EXPECT_EQ(store->Open(2, pool, kT0).code(), absl::StatusCode::kResourceExhausted);
  pool.capacity_tokens = (8 << 20) / (2 * 2 * 2 * 32) + 1;  // one token more than 8 MiB holds
  EXPECT_EQ(store->Open(2, pool, kT0).code(), absl::StatusCode::kResourceExhausted);
  pool.capacity_tokens = 1000;
  EXPECT_TRUE(store->Open(2, pool, kT0).ok());
}

TEST(KvStore, BadRequestsAreRefusedWithTheReason) {
  auto store = MakeStore();
  const SequenceSpec s = Spec();
  ASSERT_TRUE(store->Open(1, s, kT0).ok());
  AppendRows(*store, 1, s, 0, 0, 4);
  std::vector<uint8_t> buf(3 * s.row_bytes());
  std::vector<int32_t> one = {0, 0, 0};
  auto gather = [&](StoreSequenceId seq, int layer, std::vector<int32_t> slots, int64_t count) {
    GatherItem item{seq, layer, count, slots, buf.data(), buf.data()};
    return store->Gather({&item, 1});
  };
  EXPECT_EQ(gather(9, 0, one, 1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(gather(1, 2, one, 1).code(), absl::StatusCode::kInvalidArgument);
  auto out_of_range = gather(1, 0, {0, 4, 0}, 1);
  EXPECT_EQ(out_of_range.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(out_of_range.message().find("token index 4"), std::string::npos) << out_of_range;
  EXPECT_EQ(gather(1, 0, {0, 1}, 1).code(), absl::StatusCode::kInvalidArgument);  // 2 != 3 heads
  auto k = Rows(s, 4, 1, 0);
  EXPECT_EQ(store->Append(1, 0, 4, 1, k.data(), k.data(), k.size() - 1).code(),
            absl::StatusCode::kInvalidArgument);  // wrong byte count (dtype or head mismatch)
  EXPECT_EQ(store->Append(1, 0, 7, 1, k.data(), k.data(), k.size()).code(),
            absl::StatusCode::kInvalidArgument);  // a hole
  EXPECT_EQ(store->Append(1, 5, 0, 1, k.data(), k.data(), k.size()).code(),
            absl::StatusCode::kInvalidArgument);  // layer
  EXPECT_EQ(store->Open(1, s, kT0).code(), absl::StatusCode::kAlreadyExists);
  SequenceSpec wide = s;
  wide.head_dim = 1000;
  EXPECT_EQ(store->Open(2, wide, kT0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Close(42).code(), absl::StatusCode::kNotFound);
}

TEST(KvStore, AFullStoreRefusesAndLosesNothing) {
  // 1 MiB: 256 blocks of 4 KiB; a 3-head layer takes 6 blocks per 16 rows.
  auto store = MakeStore(1 << 20);
  const SequenceSpec s = Spec(1, 3, 64, DType::kBF16);  // 128-byte rows, 32 rows per block
  ASSERT_TRUE(store->Open(1, s, kT0).ok());
  AppendRows(*store, 1, s, 0, 0, 200, 1);
  ASSERT_TRUE(store->Open(2, s, kT0).ok());
  int64_t t = 0;
  absl::Status st;
  while (st.ok()) {
    auto k = Rows(s, t, 32, 0, 2), v = Rows(s, t, 32, 1, 2);
    st = store->Append(2, 0, t, 32, k.data(), v.data(), k.size());
    if (st.ok()) t += 32;
  }
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("full"), std::string::npos);
  EXPECT_EQ(*store->Length(2, 0), t);  // the refused append left no partial rows
  EXPECT_GE(store->Stats().rejections, 1);
  std::vector<int32_t> slots = {0, 199, 100, 5, 6, 7, 0, 1, 2};
  ExpectGathered(*store, 1, s, 0, slots, 3, 1);
  std::vector<int32_t> last = {static_cast<int32_t>(t - 1), static_cast<int32_t>(t - 1),
                               static_cast<int32_t>(t - 1)};
  ExpectGathered(*store, 2, s, 0, last, 1, 2);
  // Closing frees the blocks: the refused append now fits.
  ASSERT_TRUE(store->Close(1).ok());
  auto k = Rows(s, t, 32, 0, 2), v = Rows(s, t, 32, 1, 2);
  EXPECT_TRUE(store->Append(2, 0, t, 32, k.data(), v.data(), k.size()).ok());
}

TEST(KvStore, KvPoolEvictsByPolicy) {
  auto store = MakeStore();
  SequenceSpec s = Spec(1, 1, 8, DType::kF32);
  s.capacity_tokens = 4;
  s.eviction = EvictionPolicy::kFifo;
  ASSERT_TRUE(store->Open(1, s, kT0).ok());
  AppendRows(*store, 1, s, 0, 0, 4);
  std::vector<int32_t> slot(1);
  auto k = Rows(s, 4, 1, 0), v = Rows(s, 4, 1, 1);
  ASSERT_TRUE(store->Append(1, 0, 4, 1, k.data(), v.data(), k.size(), slot.data()).ok());
  EXPECT_EQ(slot[0], 0);  // FIFO: token 0's slot
  // Counter: the least fetched of the older half (tokens 0, 1). Token 0 was fetched, so
  // token 1 goes, where FIFO would have taken token 0.
  s.eviction = EvictionPolicy::kCounter;
  ASSERT_TRUE(store->Open(2, s, kT0).ok());
  AppendRows(*store, 2, s, 0, 0, 4);
  std::vector<int32_t> hot = {0};
  std::vector<uint8_t> buf(s.row_bytes());
  GatherItem item{2, 0, 1, hot, buf.data(), buf.data()};
  ASSERT_TRUE(store->Gather({&item, 1}).ok());
  ASSERT_TRUE(store->Append(2, 0, 4, 1, k.data(), v.data(), k.size(), slot.data()).ok());
  EXPECT_EQ(slot[0], 1);
  EXPECT_EQ(store->Stats().evictions, 2);
  // Evictions count tokens: one token evicted from both layers of a sequence is one.
  SequenceSpec two_layers = Spec(2, 1, 8, DType::kF32);
  two_layers.capacity_tokens = 4;
  two_layers.eviction = EvictionPolicy::kFifo;
  ASSERT_TRUE(store->Open(3, two_layers, kT0).ok());
  for (int layer = 0; layer < 2; ++layer) {
    AppendRows(*store, 3, two_layers, layer, 0, 4);
    ASSERT_TRUE(store->Append(3, layer, 4, 1, k.data(), v.data(), k.size()).ok());
  }
  EXPECT_EQ(store->Stats().evictions, 3);
}

TEST(KvStore, KvPoolRowsGoToTheSlotsTheWorkerChose) {
  auto store = MakeStore();
  SequenceSpec s = Spec(1, 2, 8, DType::kF32);
  s.capacity_tokens = 6;
  ASSERT_TRUE(store->Open(1, s, kT0).ok());
  auto append = [&](int64_t t, int64_t n, std::vector<int32_t> at) {
    auto k = Rows(s, t, n, 0), v = Rows(s, t, n, 1);
    return store->Append(1, 0, t, n, k.data(), v.data(), k.size(), nullptr, at);
  };
  // A prompt of 3 in slots 0-2, then token 3 into the free slot 3 of head 0 and over token 1 in
  // head 1 (a head's slots in use may be extended by one), token 4 over tokens 0 and 2.
  ASSERT_TRUE(append(0, 3, {0, 0, 1, 1, 2, 2}).ok());
  ASSERT_TRUE(append(3, 1, {3, 1}).ok());
  ASSERT_TRUE(append(4, 1, {0, 2}).ok());
  // Head 0 holds tokens 4, 1, 2, 3; head 1 holds 0, 3, 4 (3 slots in use, the layer 4 rows).
  const std::vector<int32_t> want = {4, 1, 2, 3, 0, 3, 4, 0};
  std::vector<uint8_t> k(8 * s.row_bytes()), v(k.size());
  const std::vector<int32_t> slots = {0, 1, 2, 3, 0, 1, 2, 3};
  GatherItem item{1, 0, 4, slots, k.data(), v.data()};
  ASSERT_TRUE(store->Gather({&item, 1}).ok());
  for (int g = 0; g < 2; ++g) {
    for (int j = 0; j < (g == 0 ? 4 : 3); ++j) {
      const size_t off = (g * 4 + j) * s.row_bytes();
      EXPECT_EQ(std::vector<uint8_t>(k.begin() + off, k.begin() + off + s.row_bytes()),
                Expected(s, want[g * 4 + j], g, 0))
          << "head " << g << " slot " << j;
    }
  }
  EXPECT_EQ(store->Stats().evictions, 1);  // 3 rows overwritten in 2 heads: counted in tokens
  // Refused, and nothing stored: a slot past the capacity, a hole (head 1 uses 3 slots: 4 would
  // leave slot 3 empty), a count that does not match, slots for a sequence without a capacity.
  for (const std::vector<int32_t>& bad :
       std::vector<std::vector<int32_t>>{{6, 0}, {0, 4}, {-1, 0}, {0}, {0, 1, 2}}) {
    const absl::Status st = append(5, 1, bad);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  }
  EXPECT_EQ(*store->Length(1, 0), 5);
  ASSERT_TRUE(store->Open(2, Spec(1, 2, 8, DType::kF32), kT0).ok());
  auto k2 = Rows(s, 0, 1, 0), v2 = Rows(s, 0, 1, 1);
  const std::vector<int32_t> at = {0, 0};
  const absl::Status st = store->Append(2, 0, 0, 1, k2.data(), v2.data(), k2.size(), nullptr, at);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("without a KV pool"), std::string::npos) << st;
}

TEST(KvStore, LeasesFreeSequencesOfOwnersThatStopped) {
  auto store = MakeStore();
  SequenceSpec a = Spec(), b = Spec();
  b.owner = "worker-b";
  ASSERT_TRUE(store->Open(1, a, kT0).ok());
  ASSERT_TRUE(store->Open(2, b, kT0).ok());
  AppendRows(*store, 1, a, 0, 0, 10);
  AppendRows(*store, 2, b, 0, 0, 10);
  const int64_t used = store->Stats().bytes_used;
  EXPECT_EQ(store->Renew("worker-a", kT0 + absl::Seconds(20)), 1);
  EXPECT_EQ(store->ReapExpired(kT0 + absl::Seconds(31)), 1);  // b's lease ended at 30 s
  EXPECT_TRUE(store->Length(1, 0).ok());
  EXPECT_EQ(store->Length(2, 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_LT(store->Stats().bytes_used, used);
  EXPECT_EQ(store->Stats().leases_expired, 1);
}

// A released sequence (its worker failed the stream, which the router moves) keeps its rows but
// no owner renews it: another worker can take it over until its lease ends, then it is freed.
TEST(KvStore, AReleasedSequenceWaitsOneLeaseForANewOwner) {
  auto store = MakeStore();
  const SequenceSpec s = Spec();  // owner worker-a
  ASSERT_TRUE(store->Open(1, s, kT0).ok());
  ASSERT_TRUE(store->Open(2, s, kT0).ok());
  AppendRows(*store, 1, s, 0, 0, 12);
  AppendRows(*store, 1, s, 1, 0, 12);
  AppendRows(*store, 2, s, 0, 0, 12);
  AppendRows(*store, 2, s, 1, 0, 12);
  ASSERT_TRUE(store->Release(1, kT0 + absl::Seconds(10)).ok());
  ASSERT_TRUE(store->Release(2, kT0 + absl::Seconds(10)).ok());
  EXPECT_EQ(store->Release(7, kT0).code(), absl::StatusCode::kNotFound);
  // Its owner's renewals no longer hold them (and an empty owner renews nothing).
  EXPECT_EQ(store->Renew("worker-a", kT0 + absl::Seconds(20)), 0);
  EXPECT_EQ(store->Renew("", kT0 + absl::Seconds(20)), 0);
  EXPECT_EQ(store->ReapExpired(kT0 + absl::Seconds(39)), 0) << "the lease runs from the release";
  // A new owner takes sequence 1 over with its rows; sequence 2, left alone, is freed.
  SequenceSpec b = s;
  b.owner = "worker-b";
  auto kept = store->Attach(1, 3, b, 100, kT0 + absl::Seconds(39));
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(*kept, 12);
  EXPECT_EQ(store->ReapExpired(kT0 + absl::Seconds(41)), 1);
  EXPECT_EQ(store->Length(2, 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->Renew("worker-b", kT0 + absl::Seconds(41)), 1);
  EXPECT_EQ(*store->Length(3, 0), 12);
}

// A worker continuing another's stream takes its sequence over under a new id: layers are cut
// to what all of them hold (and to max_length), the rows kept are the same bytes, the new owner
// appends on, and the old id is gone: the old owner's late appends and closes are refused.
TEST(KvStore, AttachHandsASequenceOverAndFencesTheOldOwner) {
  auto store = MakeStore();
  const SequenceSpec s = Spec();
  ASSERT_TRUE(store->Open(1, s, kT0).ok());
  AppendRows(*store, 1, s, 0, 0, 20);
  AppendRows(*store, 1, s, 1, 0, 19);  // the dead owner's last append reached layer 0 only
  SequenceSpec b = s;
  b.owner = "worker-b";
  auto kept = store->Attach(1, 2, b, /*max_length=*/100, kT0);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(*kept, 19);
  EXPECT_EQ(*store->Length(2, 0), 19);
  EXPECT_EQ(*store->Length(2, 1), 19);
  EXPECT_EQ(store->Stats().tokens_stored, 19);
  std::vector<int32_t> slots(s.num_kv_heads * 19);
  for (int g = 0; g < s.num_kv_heads; ++g) {
    for (int j = 0; j < 19; ++j) slots[g * 19 + j] = j;
  }
  ExpectGathered(*store, 2, s, 0, slots, 19);
  // The old id is gone: the old owner can neither append nor close.
  auto k = Rows(s, 20, 1, 0), v = Rows(s, 20, 1, 1);
  EXPECT_EQ(store->Append(1, 1, 19, 1, k.data(), v.data(), k.size()).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(store->Close(1).code(), absl::StatusCode::kNotFound);
  // The new owner appends where the kept rows end, and renews the lease.
  AppendRows(*store, 2, s, 0, 19, 2, /*salt=*/5);
  EXPECT_EQ(*store->Length(2, 0), 21);
  EXPECT_EQ(store->Renew("worker-b", kT0), 1);
  EXPECT_EQ(store->Renew("worker-a", kT0), 0);
  // max_length cuts further; a shape other than the stored one, an unknown or taken id refuse.
  ASSERT_TRUE(store->Open(3, s, kT0).ok());
  AppendRows(*store, 3, s, 0, 0, 8);
  AppendRows(*store, 3, s, 1, 0, 8);
  SequenceSpec other = b;
  other.head_dim = 16;
  EXPECT_EQ(store->Attach(3, 4, other, 100, kT0).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store->Attach(3, 2, b, 100, kT0).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(store->Attach(9, 4, b, 100, kT0).status().code(), absl::StatusCode::kNotFound);
  kept = store->Attach(3, 4, b, /*max_length=*/5, kT0);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(*kept, 5);
  EXPECT_EQ(*store->Length(4, 1), 5);
  SequenceSpec pool = s;
  pool.capacity_tokens = 16;
  ASSERT_TRUE(store->Open(5, pool, kT0).ok());
  EXPECT_EQ(store->Attach(5, 6, b, 100, kT0).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// A fork is a copy: the new sequence holds the same bytes of the first `length` tokens (across
// block boundaries), belongs to the forking owner and appends on its own; the source keeps every
// row and its owner; a copy that does not fit changes nothing; bad ids and shapes are refused.
TEST(KvStore, ForkCopiesASequenceAndLeavesItAsItWas) {
  auto store = MakeStore();
  const SequenceSpec s = Spec(2, 3, 128);  // 256-byte rows: 16 per block
  ASSERT_TRUE(store->Open(1, s, kT0).ok());
  AppendRows(*store, 1, s, 0, 0, 37);
  AppendRows(*store, 1, s, 1, 0, 37);
  const KvStoreStats before = store->Stats();
  SequenceSpec b = s;
  b.owner = "worker-b";
  auto copied = store->Fork(1, 2, b, /*length=*/30, kT0);
  ASSERT_TRUE(copied.ok()) << copied.status();
  EXPECT_EQ(*copied, 30);
  EXPECT_EQ(*store->Length(2, 1), 30);
  EXPECT_EQ(store->Stats().sequences, before.sequences + 1);
  EXPECT_EQ(store->Stats().tokens_stored, before.tokens_stored + 30);
  std::vector<int32_t> first(s.num_kv_heads * 30), all(s.num_kv_heads * 37);
  for (int g = 0; g < s.num_kv_heads; ++g) {
    for (int j = 0; j < 30; ++j) first[g * 30 + j] = j;
    for (int j = 0; j < 37; ++j) all[g * 37 + j] = j;
  }
  for (int layer = 0; layer < 2; ++layer) ExpectGathered(*store, 2, s, layer, first, 30);
  // The copy appends its own rows where the copied ones end (inside a copied block); the
  // source's rows there stay.
  AppendRows(*store, 2, s, 0, 30, 3, /*salt=*/5);
  ExpectGathered(*store, 2, s, 0, std::vector<int32_t>{30, 31, 32, 30, 31, 32, 30, 31, 32}, 3, 5);
  for (int layer = 0; layer < 2; ++layer) ExpectGathered(*store, 1, s, layer, all, 37);
  EXPECT_EQ(store->Renew("worker-b", kT0), 1);
  EXPECT_EQ(store->Renew("worker-a", kT0), 1) << "the source keeps its owner";
  // Longer than stored: what every layer holds.
  copied = store->Fork(1, 3, b, /*length=*/1000, kT0);
  ASSERT_TRUE(copied.ok()) << copied.status();
  EXPECT_EQ(*copied, 37);
  ASSERT_TRUE(store->Close(1).ok());
  ExpectGathered(*store, 3, s, 1, all, 37);
  // Refusals.
  EXPECT_EQ(store->Fork(3, 3, b, 10, kT0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Fork(9, 4, b, 10, kT0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->Fork(3, 2, b, 10, kT0).status().code(), absl::StatusCode::kAlreadyExists);
  SequenceSpec other = b;
  other.head_dim = 64;
  EXPECT_EQ(store->Fork(3, 4, other, 10, kT0).status().code(),
            absl::StatusCode::kFailedPrecondition);
  SequenceSpec pool = s;
  pool.capacity_tokens = 16;
  ASSERT_TRUE(store->Open(5, pool, kT0).ok());
  EXPECT_EQ(store->Fork(5, 6, pool, 10, kT0).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(store->Close(2).ok());
  ASSERT_TRUE(store->Close(3).ok());
  ASSERT_TRUE(store->Close(5).ok());
  EXPECT_EQ(store->Stats().bytes_used, 0);
  EXPECT_EQ(store->Stats().tokens_stored, 0);
  // A store without room for the copy: refused, nothing changed.
  auto small = MakeStore(/*capacity=*/40 * 4096);  // 40 blocks; the source takes 36
  ASSERT_TRUE(small->Open(1, s, kT0).ok());
  AppendRows(*small, 1, s, 0, 0, 37);
  AppendRows(*small, 1, s, 1, 0, 37);
  const KvStoreStats full = small->Stats();
  EXPECT_EQ(small->Fork(1, 2, b, 37, kT0).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(small->Stats().sequences, full.sequences);
  EXPECT_EQ(small->Stats().bytes_used, full.bytes_used);
  EXPECT_EQ(small->Stats().rejections, full.rejections + 1);
  ExpectGathered(*small, 1, s, 1, all, 37);
}

// Gathers lock their sequences in one global order that an Attach (a new id for the same
// sequence) does not change: gathering {10, 20}, then {20, 30} after 10 became 30, used to be
// a lock-order cycle (absl's deadlock detector ended the store process).
TEST(KvStore, GathersAcrossAnAttachKeepOneLockOrder) {
  auto store = MakeStore();
  const SequenceSpec s = Spec();
  for (StoreSequenceId id : {10, 20}) {
    ASSERT_TRUE(store->Open(id, s, kT0).ok());
    AppendRows(*store, id, s, 0, 0, 4);
    AppendRows(*store, id, s, 1, 0, 4);
  }
  std::vector<int32_t> slots(s.num_kv_heads, 2);
  std::vector<uint8_t> k(4 * s.num_kv_heads * s.row_bytes()), v(k.size());
  auto gather = [&](StoreSequenceId a, StoreSequenceId b) {
    const size_t half = k.size() / 2;
    GatherItem items[2] = {{a, 0, 1, slots, k.data(), v.data()},
                           {b, 0, 1, slots, k.data() + half, v.data() + half}};
    return store->Gather(items);
  };
  ASSERT_TRUE(gather(10, 20).ok());
  ASSERT_TRUE(store->Attach(10, 30, s, 100, kT0).ok());
  EXPECT_TRUE(gather(20, 30).ok());
  EXPECT_TRUE(gather(30, 20).ok());
}

TEST(KvStore, ConcurrentAppendsAndGathers) {
  auto store = MakeStore(16 << 20, 1 << 12);
  const SequenceSpec s = Spec(2, 2, 32, DType::kF16);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([&, w] {
      const StoreSequenceId seq = 100 + w;
      if (!store->Open(seq, s, kT0).ok()) ++failures;
      for (int64_t t = 0; t < 64; ++t) {
        auto k = Rows(s, t, 1, 0, w), v = Rows(s, t, 1, 1, w);
        if (!store->Append(seq, 0, t, 1, k.data(), v.data(), k.size()).ok()) ++failures;
        std::vector<int32_t> slots = {static_cast<int32_t>(t), 0};
        std::vector<uint8_t> ko(2 * s.row_bytes()), vo(2 * s.row_bytes());
        GatherItem item{seq, 0, 1, slots, ko.data(), vo.data()};
        if (!store->Gather({&item, 1}).ok()) ++failures;
        if (std::vector<uint8_t>(ko.begin(), ko.begin() + s.row_bytes()) !=
            Expected(s, t, 0, 0, w)) {
          ++failures;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

// docs/deploy.md's sizing: a sequence of T tokens holds, per layer, KV head and K or V, a chain
// of ceil(T / rows_per_block) blocks of block_tokens x max_row_bytes bytes, rows_per_block =
// block bytes / row bytes. Llama-3.1-8B's shape (32 layers, 8 KV heads, head_dim 128) with the
// manifests' settings (64-row blocks, --max_row_bytes=512).
TEST(KvStore, MemoryPerSequenceFollowsTheDeploySizing) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    KvStoreConfig c;
    c.capacity_bytes = size_t{64} << 20;
    c.block_tokens = 64;
    c.max_row_bytes = 512;
    c.huge_pages = false;
    auto store = KvStore::Create(c);
    ASSERT_TRUE(store.ok()) << store.status();
    const SequenceSpec s = Spec(32, 8, 128, dtype);
    ASSERT_TRUE((*store)->Open(1, s, kT0).ok());
    const int64_t tokens = 100;
    for (int layer = 0; layer < 32; ++layer) AppendRows(**store, 1, s, layer, 0, tokens);
    const int64_t block_bytes = 64 * 512;
    const int64_t rows_per_block = block_bytes / s.row_bytes();  // 64 (f32), 128 (bf16)
    const int64_t chains = 2 * 32 * 8;
    const int64_t blocks = (tokens + rows_per_block - 1) / rows_per_block;
    EXPECT_EQ((*store)->Stats().bytes_used, chains * blocks * block_bytes) << DTypeName(dtype);
  }
}

}  // namespace
}  // namespace infinigen
