// A CPU backend that presents its memory as a device's (host_accessible() is false), for tests
// of the code paths a GPU takes, run where there is none: the model copies what host code must
// read out of "device" memory, and a store cache gathers rows from registered memory into
// device staging (GatherBlockRows, and GatherRows by address: checked copies). Owns() tells
// whether a pointer is inside memory this backend allocated, so a test can assert that host code
// never reads it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "gpu_worker/backend/cpu_backend.h"

namespace infinigen::testing {

class DeviceLikeCpuBackend final : public CpuBackend {
 public:
  using CpuBackend::CpuBackend;
  bool host_accessible() const override { return false; }
  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t bytes) override;
  absl::Status RegisterHostMemory(const void* data, size_t bytes) override;
  absl::Status UnregisterHostMemory(const void* data) override;
  // The registrations held (RegisterHostMemory's, less UnregisterHostMemory's).
  size_t registered_regions() const { return registered_.size(); }
  absl::Status GatherRows(const void* const* rows, int64_t n, size_t row_bytes, void* dst) override;
  // CpuBackend's, refusing an arena outside registered memory (INVALID_ARGUMENT, as a GPU's)
  // and tables, slots, counts or dst outside this backend's memory (what a GPU reads there).
  // On the side queue, as late as a GPU may run it: at the next JoinSideQueue, or when a
  // buffer is freed (so that code reading its rows before the join reads what was there
  // before).
  absl::Status GatherBlockRows(const BlockRowsGather& g) override;
  absl::Status ForkSideQueue() override;
  absl::Status JoinSideQueue() override;
  // CpuBackend's, counting the choices that took fewer rows than they chose among; the keys,
  // query and outputs must be this backend's memory.
  absl::Status ChooseRows(const RowChoiceRequest& request, void* workspace) override;
  // A GPU's limit on the partial channels ChooseRows reads a head (CheckRowChoiceShape), from
  // now on; 0 (the default): none, as the CPU's.
  void set_max_choice_partial_dim(int d) { max_choice_partial_dim_ = d; }
  absl::Status CheckRowChoiceShape(int num_heads, int num_kv_heads, int partial_dim) const override;
  // As a GPU's: scores and mass of every row (CpuBackend needs none), which ChooseRows checks.
  size_t ChooseRowsWorkspaceBytes(int num_heads, int num_kv_heads, int64_t rows) const override {
    return static_cast<size_t>(num_heads + num_kv_heads) * static_cast<size_t>(rows) * 4;
  }

  // As a GPU's: the bytes as they are now, delivered to `host` only at the next CopyToHost or
  // Synchronize; until then `host` holds 0xff bytes (so that code reading it before its wait
  // reads garbage, not last step's bytes that may be the same).
  absl::Status CopyToHostLater(const void* device, void* host, size_t bytes) override;
  absl::Status CopyToHost(const void* device, void* host, size_t bytes) override;
  absl::Status Synchronize() override;
  // Whether p lies in a live buffer from Allocate().
  bool Owns(const void* p) const;
  // Bytes of the live buffers from Allocate(), now and at most since the last ResetPeak().
  size_t live_bytes() const;
  size_t peak_bytes() const;
  void ResetPeak();
  // Allocations of more than `bytes` fail RESOURCE_EXHAUSTED from now on (a full device).
  void FailAllocationsOver(size_t bytes) { fail_over_ = bytes; }
  int64_t rows_gathered() const { return rows_gathered_; }
  // Gathers queued on the side queue, forks of it, and the most gathers one join ran (a
  // join that runs the next layer's too has taken their overlap away). A side-queue gather
  // queued with a copy to the device after the last fork is refused (FAILED_PRECONDITION): on
  // a GPU it could read what that copy had not written yet.
  int64_t side_gathers() const { return side_gathers_; }
  int64_t side_forks() const { return side_forks_; }
  int64_t most_gathers_joined() const { return most_joined_; }
  void ResetMostGathersJoined() { most_joined_ = 0; }
  absl::Status CopyToDevice(const void* host, void* device, size_t bytes) override;
  int64_t sparse_choices() const { return sparse_choices_; }
  // CpuBackend's (one AttentionDecode per item), counting the calls and their largest batch;
  // every item's memory must be this backend's.
  absl::Status AttentionDecodeBatch(std::span<const DecodeAttentionItem> items,
                                    const AttentionShape& shape) override;
  // The kept rows' plans, checked to lie in its memory as a GPU's must; on the side queue, run
  // as late as a GPU may run them (as its gathers are).
  absl::Status PlanKeptRows(const KeptRowsPlan& p) override;
  absl::Status MapKeptRows(const KeptRowsMap& m) override;
  int64_t attention_batches() const { return attention_batches_; }
  int64_t most_attention_batch() const { return most_attention_batch_; }

 private:
  class Tracked;
  mutable std::mutex mu_;
  std::map<const char*, size_t> live_;  // start -> bytes
  size_t live_bytes_ = 0, peak_bytes_ = 0;
  std::atomic<size_t> fail_over_{SIZE_MAX};
  int max_choice_partial_dim_ = 0;
  struct Registration {
    const char* host;
    size_t bytes;
    uint64_t inode;  // of the file mapped there when registered (a store's arena: its memfd)
  };
  std::vector<Registration> registered_;
  struct Later {
    void* host;
    std::vector<char> bytes;
  };
  void DeliverLater();
  std::vector<Later> later_;  // the first later_count_ are pending
  size_t later_count_ = 0;
  int64_t rows_gathered_ = 0;
  // The side queue's work not yet run, in order: gathers and kept-row plans (capacity kept: the
  // fake allocates nothing per step).
  struct SideWork {
    bool plan = false;
    BlockRowsGather gather;
    KeptRowsPlan kept;
  };
  std::vector<SideWork> side_;
  int64_t side_gathers_ = 0, side_forks_ = 0, most_joined_ = 0;
  bool copied_since_fork_ = false;
  absl::Status RunSideQueue();
  // Whether [data, data + bytes) lies in memory registered with RegisterHostMemory.
  bool Registered(const void* data, size_t bytes) const;
  absl::Status RunBlockRows(const BlockRowsGather& g);
  int64_t sparse_choices_ = 0;
  int64_t attention_batches_ = 0, most_attention_batch_ = 0;
};

}  // namespace infinigen::testing
