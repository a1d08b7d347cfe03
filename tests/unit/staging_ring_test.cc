// StagingRing: the shm client's staging file as a ring of reservations (kv_store/client/
// staging_ring.h), over a real file in /dev/shm.
#include "kv_store/client/staging_ring.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace infinigen {
namespace {

std::shared_ptr<StagingRing> Ring(size_t bytes) {
  absl::StatusOr<std::unique_ptr<StagingWriter>> w = StagingWriter::Create("/dev/shm", bytes);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? StagingRing::Make(*std::move(w)) : nullptr;
}

TEST(StagingRing, ReservationsFollowEachOtherAndWrapWhenTheOldestIsGivenBack) {
  std::shared_ptr<StagingRing> ring = Ring(4096);
  ASSERT_NE(ring, nullptr);
  std::optional<StagedRows> a = ring->Reserve(512);   // [0, 1024)
  std::optional<StagedRows> b = ring->Reserve(1000);  // [1024, 3072): 2000 rounded up to 64s
  std::optional<StagedRows> c = ring->Reserve(500);   // [3072, 4096)
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(a->offset(), 0);
  EXPECT_EQ(b->offset(), 1024);
  EXPECT_EQ(c->offset(), 3072);
  EXPECT_EQ(b->k().data() + 1000, b->v().data()) << "V's bytes follow K's";
  EXPECT_EQ(ring->held_bytes(), 4096u);
  EXPECT_FALSE(ring->Reserve(1)) << "full";

  b.reset();  // given back out of order: the oldest (a) still holds the ring's start
  EXPECT_FALSE(ring->Reserve(32)) << "space after a reservation still held is not reused";
  EXPECT_EQ(ring->held_bytes(), 4096u);
  a.reset();  // now [0, 3072) is free
  EXPECT_EQ(ring->held_bytes(), 1024u);
  std::optional<StagedRows> d = ring->Reserve(1536);  // wraps to 0
  ASSERT_TRUE(d);
  EXPECT_EQ(d->offset(), 0);
  EXPECT_FALSE(ring->Reserve(32)) << "[3072, 4096) is c's, [0, 3072) d's";
  c.reset();
  std::optional<StagedRows> e = ring->Reserve(32);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->offset(), 3072) << "after the newest";
  EXPECT_FALSE(ring->Reserve(2049)) << "more than half the file: never";
  EXPECT_FALSE(ring->Reserve(0));
}

TEST(StagingRing, AMovedReservationGivesItsSpaceBackOnceAndOutlivesTheRingsOwner) {
  std::shared_ptr<StagingRing> ring = Ring(4096);
  ASSERT_NE(ring, nullptr);
  std::optional<StagedRows> a = ring->Reserve(1024);
  ASSERT_TRUE(a);
  std::memset(a->k().data(), 7, a->bytes());
  StagedRows moved = *std::move(a);
  StagedRows again;
  again = std::move(moved);
  EXPECT_FALSE(moved);
  EXPECT_EQ(ring->held_bytes(), 2048u);
  a.reset();  // the moved-from husk gives nothing back
  EXPECT_EQ(ring->held_bytes(), 2048u);
  const StagingRing* raw = ring.get();
  ring.reset();  // the client moved to another file: the reservation keeps this one mapped
  EXPECT_EQ(again.ring(), raw);
  EXPECT_EQ(again.k()[1023], 7);
  again = StagedRows();  // the last holder: the file goes
  EXPECT_FALSE(again);
}

// A retired ring (the client moved to another file) reserves nothing more; what it holds stays.
TEST(StagingRing, ARetiredRingReservesNothing) {
  std::shared_ptr<StagingRing> ring = Ring(4096);
  ASSERT_NE(ring, nullptr);
  std::optional<StagedRows> a = ring->Reserve(100);
  ASSERT_TRUE(a);
  std::memset(a->k().data(), 3, a->bytes());
  ring->Retire();
  EXPECT_FALSE(ring->Reserve(100));
  a.reset();
  EXPECT_FALSE(ring->Reserve(100)) << "not even once it is empty";
}

// Two threads reserve, write and give back in random sizes and orders: no reservation overlaps
// another that is held (each is filled with its own byte and checked when given back).
TEST(StagingRing, ConcurrentReservationsNeverOverlap) {
  std::shared_ptr<StagingRing> ring = Ring(64 << 10);
  ASSERT_NE(ring, nullptr);
  std::vector<std::thread> threads;
  std::atomic<int> bad{0}, reserved{0};
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::vector<std::pair<StagedRows, uint8_t>> held;
      for (int i = 0; i < 4000; ++i) {
        if (!held.empty() && (rng() % 3 == 0 || held.size() > 4)) {
          const size_t at = rng() % held.size();
          auto& [rows, byte] = held[at];
          for (uint8_t x : rows.k()) bad += x != byte;
          for (uint8_t x : rows.v()) bad += x != byte;
          held.erase(held.begin() + at);
          continue;
        }
        const uint8_t byte = static_cast<uint8_t>(rng());
        if (std::optional<StagedRows> r = ring->Reserve(1 + rng() % 1500)) {
          std::memset(r->k().data(), byte, r->bytes());
          std::memset(r->v().data(), byte, r->bytes());
          held.emplace_back(*std::move(r), byte);
          ++reserved;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
  // How many reservations fit depends on how the two threads interleaved (space after one still
  // held is not reused; one CI run under load got 1910, under the 2000 once asserted), so no count
  // is asserted but that some did. Everything given back, the whole ring can be reserved again.
  EXPECT_GT(reserved.load(), 0);
  EXPECT_EQ(ring->held_bytes(), 0u);
  EXPECT_TRUE(ring->Reserve(32 << 10)) << "K and V of 32 KiB each: the whole ring, free again";
}

}  // namespace
}  // namespace infinigen
