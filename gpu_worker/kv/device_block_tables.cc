#include "gpu_worker/kv/device_block_tables.h"

#include <algorithm>

#include "common/status_macros.h"

namespace infinigen {

absl::Status DeviceBlockTables::Reserve(Backend& backend, int64_t rows, bool grow) {
  int64_t capacity = std::max<int64_t>(BlocksFor(rows), 1);
  if (capacity <= capacity_) {
    if (device_ != nullptr) return absl::OkStatus();
    IG_ASSIGN_OR_RETURN(device_, backend.Allocate(LayerEntries() * num_layers_ * sizeof(int32_t)));
    copied_.assign(num_layers_, 0);
    return absl::OkStatus();
  }
  if (grow) capacity = std::max(capacity, 2 * capacity_);  // past the opened size: by doubling
  // The device copy first (the old freed before: the peak is no higher than admission counts),
  // so that a failure leaves the host tables, and the gathers answering into them, as they were.
  const size_t entries = static_cast<size_t>(num_layers_) * 2 * num_kv_heads_ * capacity;
  device_.reset();
  copied_.assign(num_layers_, 0);
  IG_ASSIGN_OR_RETURN(device_, backend.Allocate(entries * sizeof(int32_t)));
  // Each layer's K and V tables re-laid for the new capacity: what the store answered so far
  // kept (at most the old capacity's blocks: an answer wrote no more). The old tables stay
  // alive for gathers that may still answer into them (abandoned late).
  auto next = std::make_unique<Generation>();
  next->host.assign(entries, -1);
  next->blocks.assign(num_layers_, 0);
  if (current_ != nullptr) {
    for (int64_t list = 0; list < int64_t{num_layers_} * 2 * num_kv_heads_; ++list) {
      std::copy_n(current_->host.begin() + list * capacity_, capacity_,
                  next->host.begin() + list * capacity);
    }
    for (int l = 0; l < num_layers_; ++l) {
      next->blocks[l] = std::min(current_->blocks[l], capacity_);
    }
    retired_.push_back(std::move(current_));
  }
  current_ = std::move(next);
  capacity_ = capacity;
  return absl::OkStatus();
}

void DeviceBlockTables::Release() {
  device_.reset();
  copied_.assign(num_layers_, 0);
}

BlockTableOut DeviceBlockTables::Out(int layer) {
  // What is held: the store may have answered more blocks than there was room for.
  return {current_->host.data() + static_cast<size_t>(layer) * LayerEntries(), capacity_,
          std::min(current_->blocks[layer], capacity_), &current_->blocks[layer]};
}

absl::StatusOr<const int32_t*> DeviceBlockTables::OnDevice(Backend& backend, int layer) {
  if (device_ == nullptr) {
    return absl::FailedPreconditionError("the sequence's block tables are not on the device");
  }
  const size_t at = static_cast<size_t>(layer) * LayerEntries();
  int32_t* device = static_cast<int32_t*>(device_->data()) + at;
  const int64_t blocks = std::min(current_->blocks[layer], capacity_);
  if (blocks > copied_[layer]) {
    IG_RETURN_IF_ERROR(
        backend.CopyToDevice(current_->host.data() + at, device, LayerEntries() * sizeof(int32_t)));
    copied_[layer] = blocks;
  }
  return device;
}

}  // namespace infinigen
