#include "tests/support/device_like_backend.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace infinigen::testing {

// A CpuBackend buffer that leaves the live set when freed.
class DeviceLikeCpuBackend::Tracked final : public Buffer {
 public:
  Tracked(DeviceLikeCpuBackend& owner, std::unique_ptr<Buffer> inner)
      : owner_(owner), inner_(std::move(inner)) {}
  ~Tracked() override {
    owner_.RunSideQueue().IgnoreError();  // as cudaFree waits for the device
    std::lock_guard<std::mutex> lock(owner_.mu_);
    auto it = owner_.live_.find(static_cast<const char*>(inner_->data()));
    owner_.live_bytes_ -= it->second;
    owner_.live_.erase(it);
  }
  void* data() override { return inner_->data(); }
  size_t size() const override { return inner_->size(); }

 private:
  DeviceLikeCpuBackend& owner_;
  std::unique_ptr<Buffer> inner_;
};

absl::StatusOr<std::unique_ptr<Buffer>> DeviceLikeCpuBackend::Allocate(size_t bytes) {
  if (bytes > fail_over_.load()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the device-like backend is full (", bytes, " bytes asked)"));
  }
  auto inner = CpuBackend::Allocate(bytes);
  if (!inner.ok()) return inner.status();
  {
    std::lock_guard<std::mutex> lock(mu_);
    live_[static_cast<const char*>((*inner)->data())] = std::max<size_t>(bytes, 1);
    live_bytes_ += std::max<size_t>(bytes, 1);
    peak_bytes_ = std::max(peak_bytes_, live_bytes_);
  }
  return std::unique_ptr<Buffer>(new Tracked(*this, std::move(*inner)));
}

size_t DeviceLikeCpuBackend::live_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_bytes_;
}

size_t DeviceLikeCpuBackend::peak_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_bytes_;
}

void DeviceLikeCpuBackend::ResetPeak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_bytes_ = live_bytes_;
}

bool DeviceLikeCpuBackend::Owns(const void* p) const {
  const char* c = static_cast<const char*>(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.upper_bound(c);
  if (it == live_.begin()) return false;
  --it;
  return c < it->first + it->second;
}

absl::Status DeviceLikeCpuBackend::CopyToHostLater(const void* device, void* host, size_t bytes) {
  CountCopyToHost();
  const char* p = static_cast<const char*>(device);
  // Entries (and their byte buffers) are reused, so that this stand-in for a device allocates
  // nothing per copy once warm: an allocation test counts the product's, not the fake's.
  if (later_count_ == later_.size()) later_.emplace_back();
  Later& l = later_[later_count_++];
  l.host = host;
  l.bytes.assign(p, p + bytes);
  std::memset(host, 0xff, bytes);  // read before the wait: -1 counts and NaNs, not old bytes
  return absl::OkStatus();
}

void DeviceLikeCpuBackend::DeliverLater() {
  for (size_t i = 0; i < later_count_; ++i) {
    std::memcpy(later_[i].host, later_[i].bytes.data(), later_[i].bytes.size());
  }
  later_count_ = 0;
  HostCopiesDone();
}

absl::Status DeviceLikeCpuBackend::CopyToHost(const void* device, void* host, size_t bytes) {
  DeliverLater();
  return CpuBackend::CopyToHost(device, host, bytes);
}

absl::Status DeviceLikeCpuBackend::Synchronize() {
  DeliverLater();
  return CpuBackend::Synchronize();
}

namespace {

// The inode of the file mapped at exactly [p, p + bytes) in this process (0: no one mapping is
// exactly there): which memory a registration pinned. A GPU reads the pages pinned at
// registration, so memory mapped anew at a registered address is, for it, still the old
// memory. (No allocation: decode steps count them.)
uint64_t MappedInode(const void* p, size_t bytes) {
  char path[96];
  const auto lo = reinterpret_cast<uintptr_t>(p);
  std::snprintf(path, sizeof(path), "/proc/self/map_files/%lx-%lx", static_cast<unsigned long>(lo),
                static_cast<unsigned long>(lo + bytes));
  struct stat st;
  return ::stat(path, &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

}  // namespace

absl::Status DeviceLikeCpuBackend::RegisterHostMemory(const void* data, size_t bytes) {
  registered_.push_back({static_cast<const char*>(data), bytes, MappedInode(data, bytes)});
  return absl::OkStatus();
}

absl::Status DeviceLikeCpuBackend::UnregisterHostMemory(const void* data) {
  std::erase_if(registered_, [data](const Registration& r) { return r.host == data; });
  return absl::OkStatus();
}

bool DeviceLikeCpuBackend::Registered(const void* data, size_t bytes) const {
  const char* p = static_cast<const char*>(data);
  return std::any_of(registered_.begin(), registered_.end(), [&](const Registration& r) {
    // (Another mapping at a registered address: the pages a GPU pinned are the old ones.)
    return p >= r.host && p + bytes <= r.host + r.bytes && MappedInode(r.host, r.bytes) == r.inode;
  });
}

absl::Status DeviceLikeCpuBackend::GatherRows(const void* const* rows, int64_t n, size_t row_bytes,
                                              void* dst) {
  for (int64_t i = 0; i < n; ++i) {
    const char* p = static_cast<const char*>(rows[i]);
    if (!Registered(p, row_bytes))
      return absl::InvalidArgumentError("row outside registered memory");
    std::memcpy(static_cast<char*>(dst) + i * row_bytes, p, row_bytes);
  }
  rows_gathered_ += n;
  return absl::OkStatus();
}

absl::Status DeviceLikeCpuBackend::GatherBlockRows(const BlockRowsGather& g) {
  if (g.batch == 0 || g.max_count == 0) return CpuBackend::GatherBlockRows(g);
  IG_RETURN_IF_ERROR(CheckBlockRowsGather(g));
  if (!Registered(g.arena, g.arena_bytes)) {
    return absl::InvalidArgumentError("block-table gather outside registered memory");
  }
  for (const void* p : {static_cast<const void*>(g.tables), static_cast<const void*>(g.slots),
                        static_cast<const void*>(g.dst)}) {
    if (!Owns(p))
      return absl::InvalidArgumentError("GatherBlockRows: memory outside the backend's");
  }
  if ((g.counts != nullptr && !Owns(g.counts)) || (g.dst_rows != nullptr && !Owns(g.dst_rows)) ||
      (g.list_counts != nullptr && !Owns(g.list_counts)) ||
      (g.errors != nullptr && !Owns(g.errors))) {
    return absl::InvalidArgumentError(
        "GatherBlockRows: counts, dst_rows or errors outside the backend's memory");
  }
  if (!g.on_side_queue) return RunBlockRows(g);
  if (copied_since_fork_) {
    return absl::FailedPreconditionError(
        "GatherBlockRows: side-queue work queued after a copy to the device without a fork");
  }
  if (side_.capacity() == 0) side_.reserve(64);
  side_.push_back({false, g, {}});
  ++side_gathers_;
  return absl::OkStatus();
}

absl::Status DeviceLikeCpuBackend::AttentionDecodeBatch(std::span<const DecodeAttentionItem> items,
                                                        const AttentionShape& shape) {
  for (const DecodeAttentionItem& it : items) {
    const bool in_place = it.k.rows != nullptr;  // row tables into host memory: not a device's
    if (!Owns(it.q.data) || !Owns(it.out.data) || in_place || !Owns(it.k.data) ||
        !Owns(it.v.data) || (it.indices != nullptr && !Owns(it.indices)) ||
        (it.count != nullptr && !Owns(it.count))) {
      return absl::InvalidArgumentError("AttentionDecodeBatch: memory outside the backend's");
    }
  }
  ++attention_batches_;
  most_attention_batch_ = std::max(most_attention_batch_, static_cast<int64_t>(items.size()));
  return CpuBackend::AttentionDecodeBatch(items, shape);
}

absl::Status DeviceLikeCpuBackend::PlanKeptRows(const KeptRowsPlan& p) {
  IG_RETURN_IF_ERROR(CheckKeptRowsPlan(p));
  for (const void* q :
       {static_cast<const void*>(p.kept.row_of), static_cast<const void*>(p.kept.slot_of),
        static_cast<const void*>(p.move_slots), static_cast<const void*>(p.move_rows),
        static_cast<const void*>(p.move_counts)}) {
    if (!Owns(q)) return absl::InvalidArgumentError("PlanKeptRows: memory outside the backend's");
  }
  if ((p.list.slots != nullptr && !Owns(p.list.slots)) ||
      (p.list.count != nullptr && !Owns(p.list.count)) ||
      (p.workspace != nullptr && !Owns(p.workspace)) || (p.errors != nullptr && !Owns(p.errors)) ||
      (p.listed != nullptr && !Owns(p.listed))) {
    return absl::InvalidArgumentError(
        "PlanKeptRows: a list or scratch outside the backend's memory");
  }
  if (!p.on_side_queue) return CpuBackend::PlanKeptRows(p);
  if (copied_since_fork_) {
    return absl::FailedPreconditionError(
        "PlanKeptRows: side-queue work queued after a copy to the device without a fork");
  }
  if (side_.capacity() == 0) side_.reserve(64);
  side_.push_back({true, {}, p});
  return absl::OkStatus();
}

absl::Status DeviceLikeCpuBackend::MapKeptRows(const KeptRowsMap& m) {
  IG_RETURN_IF_ERROR(CheckKeptRowsMap(m));
  for (const void* q :
       {static_cast<const void*>(m.kept.row_of), static_cast<const void*>(m.out),
        static_cast<const void*>(m.miss_slots), static_cast<const void*>(m.miss_counts)}) {
    if (!Owns(q)) return absl::InvalidArgumentError("MapKeptRows: memory outside the backend's");
  }
  if ((m.list.slots != nullptr && !Owns(m.list.slots)) ||
      (m.list.count != nullptr && !Owns(m.list.count)) ||
      (m.errors != nullptr && !Owns(m.errors))) {
    return absl::InvalidArgumentError("MapKeptRows: a list outside the backend's memory");
  }
  return CpuBackend::MapKeptRows(m);
}

absl::Status DeviceLikeCpuBackend::RunBlockRows(const BlockRowsGather& g) {
  IG_RETURN_IF_ERROR(CpuBackend::GatherBlockRows(g));
  int64_t rows = 0;
  auto rows_of = [&g](int32_t count) {
    return std::min<int64_t>(std::max<int64_t>(count, 0), g.max_count);
  };
  for (int b = 0; b < g.batch; ++b) {
    if (g.list_counts != nullptr) {
      for (int h = 0; h < g.num_kv_heads; ++h)
        rows += rows_of(g.list_counts[b * g.num_kv_heads + h]);
    } else {
      rows += g.counts != nullptr ? g.num_kv_heads * rows_of(g.counts[b])
                                  : g.num_kv_heads * g.max_count;
    }
  }
  rows_gathered_ += rows;
  return absl::OkStatus();
}

absl::Status DeviceLikeCpuBackend::CopyToDevice(const void* host, void* device, size_t bytes) {
  copied_since_fork_ = true;
  return CpuBackend::CopyToDevice(host, device, bytes);
}

absl::Status DeviceLikeCpuBackend::RunSideQueue() {
  absl::Status status;
  for (const SideWork& w : side_) {
    absl::Status st = w.plan ? CpuBackend::PlanKeptRows(w.kept) : RunBlockRows(w.gather);
    if (status.ok()) status = st;
  }
  side_.clear();
  return status;
}

absl::Status DeviceLikeCpuBackend::ForkSideQueue() {
  ++side_forks_;
  copied_since_fork_ = false;
  return absl::OkStatus();
}

absl::Status DeviceLikeCpuBackend::JoinSideQueue() {
  const int64_t gathers =
      std::count_if(side_.begin(), side_.end(), [](const SideWork& w) { return !w.plan; });
  most_joined_ = std::max(most_joined_, gathers);
  return RunSideQueue();
}

absl::Status DeviceLikeCpuBackend::CheckRowChoiceShape(int num_heads, int num_kv_heads,
                                                       int partial_dim) const {
  if (max_choice_partial_dim_ > 0 && partial_dim > max_choice_partial_dim_) {
    return absl::InvalidArgumentError(absl::StrCat("ChooseRows reads at most ",
                                                   max_choice_partial_dim_,
                                                   " partial channels a head, got ", partial_dim));
  }
  return CpuBackend::CheckRowChoiceShape(num_heads, num_kv_heads, partial_dim);
}

absl::Status DeviceLikeCpuBackend::ChooseRows(const RowChoiceRequest& r, void* workspace) {
  IG_RETURN_IF_ERROR(
      CheckRowChoiceShape(r.num_heads, r.keys_shape.num_kv_heads, r.keys_shape.partial_dim));
  for (const void* p : {static_cast<const void*>(r.q_partial.data), r.keys,
                        static_cast<const void*>(r.indices), static_cast<const void*>(r.count)}) {
    if (!Owns(p)) return absl::InvalidArgumentError("ChooseRows: memory outside the backend's");
  }
  const size_t need = ChooseRowsWorkspaceBytes(r.num_heads, r.keys_shape.num_kv_heads, r.rows);
  if (!Owns(workspace) || !Owns(static_cast<const char*>(workspace) + need - 1)) {
    return absl::InvalidArgumentError(
        "ChooseRows: the workspace is not the backend's or too small");
  }
  IG_RETURN_IF_ERROR(CpuBackend::ChooseRows(r, workspace));
  if (*r.count < r.rows) ++sparse_choices_;
  return absl::OkStatus();
}

}  // namespace infinigen::testing
