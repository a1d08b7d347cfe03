#include "gpu_worker/kv/device_block_tables.h"

#include <algorithm>

#include "common/status_macros.h"

namespace infinigen {

absl::Status DeviceBlockTables::Reserve(Backend& backend, int64_t rows) {
  const int64_t capacity = std::max<int64_t>(BlocksFor(rows), 1);
  if (capacity <= capacity_ && device_ != nullptr) return absl::OkStatus();
  if (capacity > capacity_) {
    // Each layer's K and V tables re-laid for the new capacity (the blocks answered so far kept).
    std::vector<int32_t> host(static_cast<size_t>(num_layers_) * 2 * num_kv_heads_ * capacity, -1);
    for (int64_t list = 0; list < int64_t{num_layers_} * 2 * num_kv_heads_ && capacity_ > 0;
         ++list) {
      std::copy_n(host_.begin() + list * capacity_, capacity_, host.begin() + list * capacity);
    }
    host_ = std::move(host);
    capacity_ = capacity;
    blocks_.resize(num_layers_, 0);
  }
  device_.reset();  // the old freed first: the peak is no higher than what admission counts
  IG_ASSIGN_OR_RETURN(device_, backend.Allocate(host_.size() * sizeof(int32_t)));
  copied_.assign(num_layers_, 0);
  return absl::OkStatus();
}

void DeviceBlockTables::Release() {
  device_.reset();
  copied_.assign(num_layers_, 0);
}

BlockTableOut DeviceBlockTables::Out(int layer) {
  return {host_.data() + static_cast<size_t>(layer) * LayerEntries(), capacity_, blocks_[layer],
          &blocks_[layer]};
}

absl::StatusOr<const int32_t*> DeviceBlockTables::OnDevice(Backend& backend, int layer) {
  if (device_ == nullptr) {
    return absl::FailedPreconditionError("the sequence's block tables are not on the device");
  }
  const size_t at = static_cast<size_t>(layer) * LayerEntries();
  int32_t* device = static_cast<int32_t*>(device_->data()) + at;
  const int64_t blocks = std::min(blocks_[layer], capacity_);
  if (blocks > copied_[layer]) {
    IG_RETURN_IF_ERROR(
        backend.CopyToDevice(host_.data() + at, device, LayerEntries() * sizeof(int32_t)));
    copied_[layer] = blocks;
  }
  return device;
}

}  // namespace infinigen
