#include "kv_store/arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

#ifndef MFD_HUGETLB
#define MFD_HUGETLB 0x0004U
#endif

namespace infinigen {

absl::StatusOr<std::unique_ptr<Arena>> Arena::Create(const ArenaOptions& o) {
  if (o.block_bytes == 0 || o.capacity_bytes < o.block_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("arena capacity (", o.capacity_bytes,
                                                   " bytes) must hold at least one block of ",
                                                   o.block_bytes, " bytes"));
  }
  std::unique_ptr<Arena> a(new Arena());
  a->block_bytes_ = o.block_bytes;
  a->num_blocks_ = static_cast<int64_t>(o.capacity_bytes / o.block_bytes);
  a->mapped_bytes_ = static_cast<size_t>(a->num_blocks_) * o.block_bytes;
  constexpr size_t kHugePage = 2 << 20;
  if (!o.shared) {
    void* p = ::mmap(nullptr, a->mapped_bytes_, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot map a ", a->mapped_bytes_, "-byte arena: ", std::strerror(errno)));
    }
    a->base_ = static_cast<uint8_t*>(p);
    if (o.huge_pages) a->huge_pages_ = ::madvise(p, a->mapped_bytes_, MADV_HUGEPAGE) == 0;
    a->free_.reserve(a->num_blocks_);
    for (int64_t b = a->num_blocks_ - 1; b >= 0; --b) a->free_.push_back(static_cast<int32_t>(b));
    a->StartPrefaulter(o.prefault_ahead_bytes);
    return a;
  }
  // Huge pages first when asked for; any failure (none reserved) falls back to normal pages.
  for (bool huge : {true, false}) {
    if (huge && (!o.huge_pages || !o.shm_path.empty() || a->mapped_bytes_ % kHugePage != 0)) {
      continue;
    }
    if (!o.shm_path.empty()) {
      a->fd_ = ::open(o.shm_path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    } else {
      a->fd_ = ::memfd_create("infinigen-kvstore", MFD_CLOEXEC | (huge ? MFD_HUGETLB : 0));
    }
    if (a->fd_ < 0) continue;
    void* p = MAP_FAILED;
    if (::ftruncate(a->fd_, static_cast<off_t>(a->mapped_bytes_)) == 0) {
      p = ::mmap(nullptr, a->mapped_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd_, 0);
    }
    if (p == MAP_FAILED) {
      ::close(a->fd_);
      a->fd_ = -1;
      continue;
    }
    a->base_ = static_cast<uint8_t*>(p);
    a->huge_pages_ = huge;
    break;
  }
  if (a->base_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot create and map a ", a->mapped_bytes_,
                                                     "-byte arena: ", std::strerror(errno)));
  }
  if (!o.shm_path.empty()) {
    a->share_path_ = o.shm_path;
    a->unlink_on_close_ = true;
  } else {
    a->share_path_ = absl::StrCat("/proc/", ::getpid(), "/fd/", a->fd_);
  }
  if (!a->huge_pages_ && o.huge_pages) ::madvise(a->base_, a->mapped_bytes_, MADV_HUGEPAGE);
  a->free_.reserve(a->num_blocks_);
  for (int64_t b = a->num_blocks_ - 1; b >= 0; --b) a->free_.push_back(static_cast<int32_t>(b));
  a->StartPrefaulter(o.prefault_ahead_bytes);
  return a;
}

void Arena::StartPrefaulter(size_t ahead_bytes) {
  if (ahead_bytes > 0) {
    prefaulter_ = std::make_unique<ArenaPrefaulter>(base_, mapped_bytes_, ahead_bytes);
  }
}

Arena::~Arena() {
  prefaulter_.reset();  // its thread commits pages of the mapping: stopped before the unmap
  if (base_ != nullptr) ::munmap(base_, mapped_bytes_);
  if (fd_ >= 0) ::close(fd_);
  if (unlink_on_close_) ::unlink(share_path_.c_str());
}

absl::StatusOr<std::vector<int32_t>> Arena::Allocate(int64_t count) {
  if (count > static_cast<int64_t>(free_.size())) {
    return absl::ResourceExhaustedError(absl::StrCat("KV store full: ", count, " blocks of ",
                                                     block_bytes_, " bytes needed, ", free_.size(),
                                                     " free of ", num_blocks_));
  }
  std::vector<int32_t> blocks(free_.end() - count, free_.end());
  free_.resize(free_.size() - count);
  const size_t high_water = high_water_bytes_;
  for (int32_t b : blocks) {
    high_water_bytes_ = std::max(high_water_bytes_, (static_cast<size_t>(b) + 1) * block_bytes_);
  }
  if (prefaulter_ != nullptr && high_water_bytes_ > high_water) {
    prefaulter_->Reached(high_water_bytes_);
  }
  return blocks;
}

void Arena::Free(const std::vector<int32_t>& blocks) {
  free_.insert(free_.end(), blocks.begin(), blocks.end());
}

}  // namespace infinigen
