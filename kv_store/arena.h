// Host memory for the KV store: one mapping of `capacity` bytes cut into fixed-size blocks.
// The mapping is a memfd (MAP_SHARED), so a collocated worker can map the same pages (through
// /proc/<pid>/fd/<fd>, or a named file in /dev/shm when one is configured) and gather by local
// copies. Huge pages are used when the system has them. Not thread-safe: the store serializes
// block allocation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kv_store/arena_prefaulter.h"

namespace infinigen {

struct ArenaOptions {
  size_t capacity_bytes = size_t{1} << 30;
  size_t block_bytes = 64 << 10;
  // Shared: a memfd (or `shm_path`) that collocated workers can map. Not shared: private
  // anonymous memory, which transparent huge pages back on most systems (shared memory rarely
  // gets them: shmem_enabled is usually "never"), so random-row gathers miss the TLB less.
  bool shared = true;
  std::string shm_path;    // "": an anonymous memfd; else this file (e.g. /dev/shm/...)
  bool huge_pages = true;  // try MFD_HUGETLB (shared) and madvise(MADV_HUGEPAGE)
  // Bytes kept committed past the highest block handed out, by a thread of the arena's
  // (arena_prefaulter.h); 0: none, pages fault in as rows are first written.
  size_t prefault_ahead_bytes = 0;
};

class Arena {
 public:
  static absl::StatusOr<std::unique_ptr<Arena>> Create(const ArenaOptions& options);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  uint8_t* base() const { return base_; }
  size_t block_bytes() const { return block_bytes_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }
  bool huge_pages() const { return huge_pages_; }
  // A path another process on this host can open to map the arena.
  const std::string& share_path() const { return share_path_; }

  // Where the highest block ever handed out ends, in bytes from the base: blocks past it have
  // never been written (the free list hands out fresh blocks in address order).
  size_t high_water_bytes() const { return high_water_bytes_; }

  // Null with ArenaOptions::prefault_ahead_bytes 0.
  const ArenaPrefaulter* prefaulter() const { return prefaulter_.get(); }

  // Takes `count` blocks, all or none: RESOURCE_EXHAUSTED leaves the arena unchanged (blocks
  // past the high water mark have the prefaulter commit that much further).
  absl::StatusOr<std::vector<int32_t>> Allocate(int64_t count);
  void Free(const std::vector<int32_t>& blocks);
  uint8_t* Block(int32_t block) const { return base_ + static_cast<size_t>(block) * block_bytes_; }

 private:
  Arena() = default;
  void StartPrefaulter(size_t ahead_bytes);

  int fd_ = -1;
  uint8_t* base_ = nullptr;
  size_t mapped_bytes_ = 0;
  size_t block_bytes_ = 0;
  int64_t num_blocks_ = 0;
  bool huge_pages_ = false;
  std::string share_path_;
  bool unlink_on_close_ = false;
  std::vector<int32_t> free_;  // LIFO free list
  size_t high_water_bytes_ = 0;
  std::unique_ptr<ArenaPrefaulter> prefaulter_;  // stopped first in ~Arena, before the unmap
};

}  // namespace infinigen
