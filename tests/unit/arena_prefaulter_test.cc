// The arena's pages committed ahead of the store's blocks (kv_store/arena_prefaulter.h): exactly
// the range asked for, page residency read back with mincore(); the bytes already there left as
// they are while a writer fills them; and the store asking for its high water mark plus the
// configured bytes as its blocks grow.
#include "kv_store/arena_prefaulter.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <thread>
#include <vector>

#include "kv_store/kv_store.h"

namespace infinigen {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// Private anonymous memory of small pages (residency page by page, as mincore reports it).
class Mapping {
 public:
  explicit Mapping(size_t bytes) : bytes_(bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    base_ = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
    if (base_ != nullptr) ::madvise(base_, bytes_, MADV_NOHUGEPAGE);
  }
  ~Mapping() {
    if (base_ != nullptr) ::munmap(base_, bytes_);
  }
  uint8_t* base() const { return base_; }

  // Pages of [from, to) resident in memory, counted.
  size_t ResidentPages(size_t from, size_t to) const {
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    std::vector<unsigned char> vec((to - from + page - 1) / page);
    if (::mincore(base_ + from, to - from, vec.data()) != 0) return SIZE_MAX;
    size_t resident = 0;
    for (unsigned char v : vec) resident += v & 1;
    return resident;
  }
  size_t Pages(size_t from, size_t to) const {
    return (to - from) / static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  }

 private:
  uint8_t* base_ = nullptr;
  size_t bytes_;
};

// Long: the store's thread runs at idle priority, and the tests may share busy cores.
absl::Time Soon() { return absl::Now() + absl::Seconds(120); }

TEST(ArenaPrefaulter, CommitsTheRangeAheadOfTheHighWaterMarkAndNoMore) {
  Mapping m(64 * kMiB);
  ASSERT_NE(m.base(), nullptr);
  ArenaPrefaulter prefaulter(m.base(), 64 * kMiB, 8 * kMiB, /*idle_priority=*/false);
  const bool committed = prefaulter.WaitCommitted(8 * kMiB, Soon());
  if (!committed && !prefaulter.working()) {
    GTEST_SKIP() << "this kernel refuses MADV_POPULATE_WRITE (Linux 5.14)";
  }
  ASSERT_TRUE(committed);
  EXPECT_EQ(prefaulter.committed_bytes(), 8 * kMiB);
  EXPECT_EQ(m.ResidentPages(0, 8 * kMiB), m.Pages(0, 8 * kMiB));
  EXPECT_EQ(m.ResidentPages(8 * kMiB, 64 * kMiB), 0u);

  prefaulter.Reached(20 * kMiB);  // blocks up to 20 MiB handed out: 28 MiB wanted
  ASSERT_TRUE(prefaulter.WaitCommitted(28 * kMiB, Soon()));
  EXPECT_EQ(m.ResidentPages(0, 28 * kMiB), m.Pages(0, 28 * kMiB));
  prefaulter.Reached(4 * kMiB);  // a lower mark (blocks reused) asks for nothing more
  EXPECT_FALSE(prefaulter.WaitCommitted(29 * kMiB, absl::Now() + absl::Milliseconds(200)));
  EXPECT_EQ(prefaulter.committed_bytes(), 28 * kMiB);
  EXPECT_EQ(m.ResidentPages(28 * kMiB, 64 * kMiB), 0u);

  prefaulter.Reached(60 * kMiB);  // capped at the arena
  ASSERT_TRUE(prefaulter.WaitCommitted(64 * kMiB, Soon()));
  EXPECT_EQ(prefaulter.committed_bytes(), 64 * kMiB);
  EXPECT_EQ(m.ResidentPages(0, 64 * kMiB), m.Pages(0, 64 * kMiB));
}

// Committing writes nothing: bytes a writer puts in the pages while they are committed stay.
TEST(ArenaPrefaulter, BytesWrittenWhileItCommitsStayAsWritten) {
  constexpr size_t kBytes = 32 * kMiB;
  Mapping m(kBytes);
  ASSERT_NE(m.base(), nullptr);
  std::atomic<bool> done{false};
  std::thread writer([&] {
    for (size_t i = 0; i < kBytes; i += 512) m.base()[i] = static_cast<uint8_t>(1 + i / 512 % 251);
    done = true;
  });
  bool committed = false, working = false;
  {
    ArenaPrefaulter prefaulter(m.base(), kBytes, kBytes, /*idle_priority=*/false);
    committed = prefaulter.WaitCommitted(kBytes, Soon());
    working = prefaulter.working();
    writer.join();
  }
  ASSERT_TRUE(done);
  if (!committed && !working) GTEST_SKIP() << "this kernel refuses MADV_POPULATE_WRITE";
  ASSERT_TRUE(committed);
  size_t wrong = 0;
  for (size_t i = 0; i < kBytes; i += 512) {
    wrong += m.base()[i] != static_cast<uint8_t>(1 + i / 512 % 251);
    wrong += m.base()[i + 1] != 0;  // never written: zero
  }
  EXPECT_EQ(wrong, 0u);
}

TEST(ArenaPrefaulter, TheStoreKeepsItsBytesCommittedPastItsBlocks) {
  KvStoreConfig c;
  c.capacity_bytes = 64 * kMiB;
  c.block_tokens = 16;
  c.max_row_bytes = 256;  // 4 KiB blocks
  c.huge_pages = false;
  c.shared_memory = false;
  c.prefault_ahead_bytes = 2 * kMiB;
  auto store = KvStore::Create(c);
  ASSERT_TRUE(store.ok()) << store.status();
  const ArenaPrefaulter* prefaulter = (*store)->arena().prefaulter();
  ASSERT_NE(prefaulter, nullptr);
  if (!prefaulter->WaitCommitted(2 * kMiB, Soon()) && !prefaulter->working()) {
    GTEST_SKIP() << "this kernel refuses MADV_POPULATE_WRITE (Linux 5.14)";
  }
  SequenceSpec spec;
  spec.num_layers = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 128;
  spec.dtype = DType::kBF16;  // 256-byte rows: 16 a block
  spec.owner = "w";
  ASSERT_TRUE((*store)->Open(1, spec, absl::Now()).ok());
  // 1024 tokens: 64 blocks of 4 KiB per (layer, head, K or V), 4 MiB of blocks in all.
  const int64_t tokens = 1024;
  std::vector<uint8_t> rows(static_cast<size_t>(tokens * spec.num_kv_heads * spec.row_bytes()), 7);
  for (int layer = 0; layer < spec.num_layers; ++layer) {
    ASSERT_TRUE((*store)->Append(1, layer, 0, tokens, rows.data(), rows.data(), rows.size()).ok());
  }
  const size_t high_water = (*store)->arena().high_water_bytes();
  EXPECT_EQ(high_water, 4 * kMiB);
  EXPECT_TRUE(prefaulter->WaitCommitted(high_water + 2 * kMiB, Soon()));
  EXPECT_EQ(prefaulter->committed_bytes(), high_water + 2 * kMiB);

  c.prefault_ahead_bytes = 0;
  auto without = KvStore::Create(c);
  ASSERT_TRUE(without.ok());
  EXPECT_EQ((*without)->arena().prefaulter(), nullptr);
}

// Blocks of 2560 bytes (head_dim 80 in bf16): high water marks that are no page boundary. The
// committed range is rounded to whole pages (madvise refuses an unaligned start), and
// prefaulting goes on past several of them.
TEST(ArenaPrefaulter, BlocksOfNoWholePagesKeepItGoing) {
  KvStoreConfig c;
  c.capacity_bytes = 16 * kMiB;
  c.block_tokens = 16;
  c.max_row_bytes = 160;
  c.huge_pages = false;
  c.shared_memory = false;
  c.prefault_ahead_bytes = 100 * 1000;  // no whole number of pages either
  auto store = KvStore::Create(c);
  ASSERT_TRUE(store.ok()) << store.status();
  const ArenaPrefaulter* prefaulter = (*store)->arena().prefaulter();
  ASSERT_NE(prefaulter, nullptr);
  if (!prefaulter->WaitCommitted(100 * 1000, Soon()) && !prefaulter->working()) {
    GTEST_SKIP() << "this kernel refuses MADV_POPULATE_WRITE (Linux 5.14)";
  }
  SequenceSpec spec;
  spec.num_layers = 1;
  spec.num_kv_heads = 1;
  spec.head_dim = 80;
  spec.dtype = DType::kBF16;
  spec.owner = "w";
  ASSERT_TRUE((*store)->Open(1, spec, absl::Now()).ok());
  std::vector<uint8_t> rows(static_cast<size_t>(16 * 3 * spec.row_bytes()), 5);
  for (int64_t start = 0; start < 16 * 3 * 40; start += 16 * 3) {  // 3 blocks of K and V a step
    ASSERT_TRUE((*store)->Append(1, 0, start, 16 * 3, rows.data(), rows.data(), rows.size()).ok());
    const size_t want = (*store)->arena().high_water_bytes() + 100 * 1000;
    ASSERT_TRUE(prefaulter->WaitCommitted(want, Soon())) << "at token " << start;
    ASSERT_TRUE(prefaulter->working());
  }
}

}  // namespace
}  // namespace infinigen
