// The shm client's staging file used as a ring: AppendAsync writes an append's rows straight into
// space reserved in the file (StagingRing::Reserve), so that on the client's side they are copied
// once, not into the queue and then into the file; the AppendBatch call names their offset and
// the store copies them into its arena. A reservation (StagedRows) gives its space back when it
// is destroyed, after its call. Reservations are given back in any order; the space is reused
// from the oldest one still held (a ring: a reservation never straddles the file's end).
//
// After a call through the file fails the store may still read it late, so the client moves to a
// new file (a new ring) and never writes the old one again; rows staged there are read from it
// (the client keeps it mapped while a reservation holds it) and sent in the call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kv_store/staging_file.h"

namespace infinigen {

class StagingRing;

// An append's K and V rows in a staging file: `bytes` of K at offset(), then as many of V.
// Move-only; gives its space back to the ring when destroyed. Empty (no ring): not staged.
class StagedRows {
 public:
  StagedRows() = default;
  ~StagedRows();
  StagedRows(StagedRows&& o) noexcept { *this = std::move(o); }
  StagedRows& operator=(StagedRows&& o) noexcept;
  StagedRows(const StagedRows&) = delete;
  StagedRows& operator=(const StagedRows&) = delete;

  explicit operator bool() const { return ring_ != nullptr; }
  const StagingRing* ring() const { return ring_.get(); }
  int64_t offset() const { return offset_; }
  size_t bytes() const { return bytes_; }
  std::span<uint8_t> k();
  std::span<uint8_t> v();
  std::span<const uint8_t> k() const;
  std::span<const uint8_t> v() const;

 private:
  friend class StagingRing;
  StagedRows(std::shared_ptr<StagingRing> ring, int64_t offset, size_t bytes)
      : ring_(std::move(ring)), offset_(offset), bytes_(bytes) {}
  void Reset();

  std::shared_ptr<StagingRing> ring_;
  int64_t offset_ = 0;
  size_t bytes_ = 0;
};

class StagingRing : public std::enable_shared_from_this<StagingRing> {
 public:
  static std::shared_ptr<StagingRing> Make(std::unique_ptr<StagingWriter> file);

  // Space for `bytes` of K and as many of V, or nullopt when the file has not that much free in
  // one piece (or bytes is 0). Thread-safe.
  std::optional<StagedRows> Reserve(size_t bytes);
  StagingWriter& file() { return *file_; }
  // Bytes held by reservations (those of a wrapped ring's unused tail included). Thread-safe.
  size_t held_bytes();
  // No more reservations (the client moved to another file: a call that failed may still read
  // this one, so space given back here is never written again). Thread-safe; a Reserve that
  // got the ring before this returns nullopt after it.
  void Retire();

  // Reservations start at multiples of this.
  static constexpr size_t kAlignment = 64;

 private:
  explicit StagingRing(std::unique_ptr<StagingWriter> file) : file_(std::move(file)) {}
  friend class StagedRows;
  void Free(int64_t offset);

  const std::unique_ptr<StagingWriter> file_;
  absl::Mutex mu_;
  struct Region {
    int64_t offset;
    size_t bytes;
    bool freed;
  };
  std::deque<Region> held_ ABSL_GUARDED_BY(mu_);  // in the order reserved, oldest first
  size_t head_ ABSL_GUARDED_BY(mu_) = 0;          // where the next reservation may start
  bool retired_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace infinigen
