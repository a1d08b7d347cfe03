#include "kv_store/client/staging_ring.h"

#include <algorithm>

namespace infinigen {

StagedRows::~StagedRows() { Reset(); }

StagedRows& StagedRows::operator=(StagedRows&& o) noexcept {
  if (this != &o) {
    Reset();
    ring_ = std::move(o.ring_);
    offset_ = o.offset_;
    bytes_ = o.bytes_;
    o.ring_.reset();
  }
  return *this;
}

void StagedRows::Reset() {
  if (ring_ != nullptr) ring_->Free(offset_);
  ring_.reset();
}

std::span<uint8_t> StagedRows::k() { return {ring_->file_->data() + offset_, bytes_}; }
std::span<uint8_t> StagedRows::v() { return {ring_->file_->data() + offset_ + bytes_, bytes_}; }
std::span<const uint8_t> StagedRows::k() const { return {ring_->file_->data() + offset_, bytes_}; }
std::span<const uint8_t> StagedRows::v() const {
  return {ring_->file_->data() + offset_ + bytes_, bytes_};
}

std::shared_ptr<StagingRing> StagingRing::Make(std::unique_ptr<StagingWriter> file) {
  return std::shared_ptr<StagingRing>(new StagingRing(std::move(file)));
}

std::optional<StagedRows> StagingRing::Reserve(size_t bytes) {
  const size_t size = file_->size();
  if (bytes == 0 || bytes > size / 2) return std::nullopt;
  const size_t need = (2 * bytes + kAlignment - 1) / kAlignment * kAlignment;
  absl::MutexLock lock(&mu_);
  if (retired_) return std::nullopt;
  size_t at;
  if (held_.empty()) {
    at = 0;
  } else {
    const size_t oldest = static_cast<size_t>(held_.front().offset);
    if (head_ > oldest) {  // held: [oldest, head_)
      if (need <= size - head_) {
        at = head_;
      } else if (need <= oldest) {
        at = 0;  // wraps; [head_, size) is left unused until the ring empties past it
      } else {
        return std::nullopt;
      }
    } else if (need <= oldest - head_) {  // wrapped, held: [oldest, size) and [0, head_)
      at = head_;
    } else {
      return std::nullopt;
    }
  }
  if (need > size - at) return std::nullopt;  // (the file's size is not a multiple of 64)
  held_.push_back({static_cast<int64_t>(at), need, false});
  head_ = at + need;
  return StagedRows(shared_from_this(), static_cast<int64_t>(at), bytes);
}

void StagingRing::Free(int64_t offset) {
  absl::MutexLock lock(&mu_);
  auto it = std::find_if(held_.begin(), held_.end(),
                         [offset](const Region& r) { return r.offset == offset && !r.freed; });
  if (it != held_.end()) it->freed = true;
  while (!held_.empty() && held_.front().freed) held_.pop_front();
  if (held_.empty()) head_ = 0;
}

void StagingRing::Retire() {
  absl::MutexLock lock(&mu_);
  retired_ = true;
}

size_t StagingRing::held_bytes() {
  absl::MutexLock lock(&mu_);
  if (held_.empty()) return 0;
  const size_t oldest = static_cast<size_t>(held_.front().offset);
  return head_ > oldest ? head_ - oldest : file_->size() - oldest + head_;
}

}  // namespace infinigen
