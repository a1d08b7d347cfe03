// The shm data plane, for a worker on the store's host: the store's arena is mapped read-only
// here and gathers copy rows straight out of it (or answer their addresses, in place), using
// block tables fetched once per block of new rows: no RPC per gather.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "kv_store/client/data_plane.h"
#include "kv_store/row_copy.h"

namespace infinigen {
namespace {

// Gathers copying at least this many bytes use the client's copy threads.
constexpr size_t kParallelCopyBytes = 2 << 20;

class ShmDataPlane final : public KvDataPlane {
 public:
  ShmDataPlane(KvControlPlane& control, const KvClientConfig& config)
      : control_(control),
        connect_timeout_(config.connect_timeout),
        gather_threads_(config.gather_threads),
        staging_bytes_(config.append_staging_bytes) {}
  ~ShmDataPlane() override {
    if (arena_ != nullptr) ::munmap(const_cast<uint8_t*>(arena_), arena_bytes_);
  }

  std::string name() const override { return "shm"; }
  bool reads_in_place() const override { return true; }
  KvStoreClient::Span mapped_memory() const override {
    return {arena_, arena_bytes_, static_cast<size_t>(block_bytes_), generation_};
  }

  std::shared_ptr<StagingRing> append_staging() override {
    absl::MutexLock lock(&staging_mu_);
    return staging_;
  }
  std::string TakeReleasedStaging() override { return std::exchange(released_, std::string()); }
  void RenewAppendStaging(bool stop) override {
    std::shared_ptr<StagingRing> next;
    if (stop) staging_dir_.clear();
    if (!staging_dir_.empty()) {
      absl::StatusOr<std::unique_ptr<StagingWriter>> w =
          StagingWriter::Create(staging_dir_, staging_bytes_);
      if (w.ok()) next = StagingRing::Make(*std::move(w));  // else appends carry their rows
    }
    absl::MutexLock lock(&staging_mu_);
    // A caller may still hold the old ring (StageRows): it reserves nothing there any more.
    if (staging_ != nullptr) staging_->Retire();
    // Unlinked: a store still reading it keeps its mapping, let go at the next call. Rows staged
    // in it are read from it here while their appends are queued, and sent in the call.
    if (staging_ != nullptr && staging_->file().unlinked()) released_ = staging_->file().path();
    staging_ = std::move(next);
  }

  // Maps the store's arena; at the first, makes the append staging file where the store takes
  // one (a restarted store's is in the same folder: it stays).
  absl::Status Connect() override {
    IG_ASSIGN_OR_RETURN(const StoreDescription d, control_.Describe(connect_timeout_));
    if (!connected_once_) {
      connected_once_ = true;
      if (staging_bytes_ > 0) staging_dir_ = d.staging_dir;
      RenewAppendStaging(/*stop=*/false);  // (before the client's threads start)
    }
    if (d.shm_path.empty()) {
      return absl::FailedPreconditionError(
          "the KV store does not share its arena (--shared_memory=false): use the grpc transport");
    }
    const int fd = ::open(d.shm_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return absl::PermissionDeniedError(absl::StrCat(
          "cannot open the KV store's arena ", d.shm_path, ": ", std::strerror(errno),
          " (the shm transport needs the store on this host, with the same user or a shared "
          "memory volume)"));
    }
    void* p = ::mmap(nullptr, static_cast<size_t>(d.arena_bytes), PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) {
      return absl::InternalError(
          absl::StrCat("cannot map the KV store's arena: ", std::strerror(errno)));
    }
    // A restarted store: what was known of the old one's blocks is void, and its arena goes.
    if (arena_ != nullptr) ::munmap(const_cast<uint8_t*>(arena_), arena_bytes_);
    tables_.clear();
    {
      absl::MutexLock lock(&appended_mu_);
      appended_.clear();
    }
    arena_ = static_cast<const uint8_t*>(p);
    ++generation_;
    arena_bytes_ = static_cast<size_t>(d.arena_bytes);
    block_bytes_ = d.block_bytes;
    instance_ = d.instance;
    return absl::OkStatus();
  }

  // The store restarted since its arena was mapped: map the new one. Rows answered in place
  // before are void from here; the worker opens sequences between steps, holding none.
  absl::Status Opened(uint64_t instance) override {
    return instance == instance_ ? absl::OkStatus() : Connect();
  }

  void Closed(StoreSequenceId seq) override {
    for (auto it = tables_.begin(); it != tables_.end();) {
      if (it->first.first == seq) {
        tables_.erase(it++);
      } else {
        ++it;
      }
    }
    absl::MutexLock lock(&appended_mu_);
    absl::erase_if(appended_, [seq](const auto& e) { return e.first.first == seq; });
  }

  void Appended(StoreSequenceId seq, int layer, int64_t rows) override {
    absl::MutexLock lock(&appended_mu_);
    appended_[{seq, layer}] = rows;
  }

  absl::Status Gather(const std::vector<ClientGatherItem>& items, const OpenSpecs& specs) override {
    copies_.clear();
    size_t copy_bytes = 0;
    for (const auto& it : items) {
      auto spec = specs.find(it.seq);
      if (spec == specs.end()) {
        return absl::NotFoundError(
            absl::StrCat("sequence ", it.seq, " is not open on this client"));
      }
      const int heads = spec->second.num_kv_heads;
      if (it.layer < 0 || it.layer >= spec->second.num_layers) {
        return absl::InvalidArgumentError(absl::StrCat("layer ", it.layer, " out of range"));
      }
      if (!CountMatches(it.count, heads, it.slots.size())) {
        return absl::InvalidArgumentError(absl::StrCat(it.slots.size(), " indices given for ",
                                                       it.count, " rows x ", heads, " KV heads"));
      }
      StoreBlockTable& t = tables_[{it.seq, it.layer}];
      int32_t max_slot = -1;
      for (int32_t s : it.slots) max_slot = std::max(max_slot, s);
      // Rows this client appended itself need no RPC while they lie in blocks the table
      // already lists (a new block every block_bytes_ / row_bytes tokens); a KV pool's slots
      // are not positions, so its tables are asked for.
      const int64_t per_block = block_bytes_ / spec->second.row_bytes();
      // After a failed append the store may have restarted (its arena mapped anew, a file it
      // reuses truncated) or dropped the sequence: ask it before reading the mapping.
      const int64_t appended = AppendedRows(it.seq, it.layer);
      const bool ask = appended == kAppendFailed;
      int64_t rows = appended >= 0 && spec->second.capacity_tokens == 0 ? appended : t.rows;
      if (ask || max_slot >= rows || max_slot >= t.blocks_per_head * per_block) {
        IG_RETURN_IF_ERROR(RefreshTable(it.seq, it.layer, t));
        rows = t.rows;
      }
      for (int32_t slot : it.slots) {
        if (slot < 0 || slot >= rows) {
          return absl::InvalidArgumentError(
              absl::StrCat("token index ", slot, " is outside [0, ", rows, ")"));
        }
      }
      if (it.block_table.requested()) {
        if (it.block_table.known < 0 || it.block_table.capacity < 0) {
          return absl::InvalidArgumentError(
              "a block table's known blocks and capacity must not be negative");
        }
        for (int g = 0; g < heads; ++g) {
          AnswerHeadBlocks(it.block_table, heads, g, t.k_blocks.data() + g * t.blocks_per_head,
                           t.v_blocks.data() + g * t.blocks_per_head, t.blocks_per_head);
        }
        *it.block_table.blocks = t.blocks_per_head;
        continue;
      }
      const bool in_place = it.k_rows != nullptr && it.v_rows != nullptr;
      for (int g = 0; g < heads; ++g) {
        const int32_t* idx = it.slots.data() + g * it.count;
        if (in_place) {
          HeadRowAddresses(HeadView(t, g, per_block), idx, it.count, it.k_rows + g * it.count,
                           it.v_rows + g * it.count);
        }
        if (!in_place && it.count > 0) {
          copies_.push_back({&it, &t, g, per_block});
          copy_bytes += 2 * static_cast<size_t>(it.count * t.row_bytes);
        }
      }
    }
    // Every item checked: copy the rows, one (item, KV head) per task.
    auto copy = [&](int64_t u) { CopyRows(copies_[u]); };
    if (copy_bytes >= kParallelCopyBytes && gather_threads_ > 1) {
      if (pool_ == nullptr) pool_ = std::make_unique<ThreadPool>(gather_threads_);
      pool_->ParallelFor(static_cast<int64_t>(copies_.size()), copy);
    } else {
      for (int64_t u = 0; u < static_cast<int64_t>(copies_.size()); ++u) copy(u);
    }
    return absl::OkStatus();
  }

 private:
  absl::Status RefreshTable(StoreSequenceId seq, int layer, StoreBlockTable& t) {
    IG_ASSIGN_OR_RETURN(StoreBlockTable fresh, control_.Blocks(seq, layer));
    if (fresh.instance != instance_) {  // blocks of another run's arena than the one mapped
      return absl::UnavailableError(
          "the KV store restarted: its sequences are gone and its arena is mapped at the next "
          "Open");
    }
    t = std::move(fresh);
    return absl::OkStatus();
  }

  // Rows of `layer` of `seq` known to be in the store (Appended; -1: none appended yet).
  int64_t AppendedRows(StoreSequenceId seq, int layer) {
    absl::MutexLock lock(&appended_mu_);
    auto it = appended_.find({seq, layer});
    return it == appended_.end() ? -1 : it->second;
  }

  // One KV head of an item, read from the mapped arena.
  struct CopyJob {
    const ClientGatherItem* item;
    const StoreBlockTable* table;
    int head;
    int64_t per_block;
  };
  void CopyRows(const CopyJob& c) const {
    const ClientGatherItem& it = *c.item;
    const StoreBlockTable& t = *c.table;
    const int g = c.head;
    const int32_t* idx = it.slots.data() + g * it.count;
    const size_t dst = static_cast<size_t>(g * it.count * t.row_bytes);
    CopyHeadRows(HeadView(t, g, c.per_block), idx, it.count, it.k_out + dst, it.v_out + dst);
  }
  // One KV head's rows of a layer in the mapped arena.
  HeadRowsView HeadView(const StoreBlockTable& t, int head, int64_t per_block) const {
    return {arena_,
            static_cast<size_t>(block_bytes_),
            t.k_blocks.data() + head * t.blocks_per_head,
            t.v_blocks.data() + head * t.blocks_per_head,
            t.row_bytes,
            per_block};
  }

  KvControlPlane& control_;
  const absl::Duration connect_timeout_;
  const int gather_threads_;
  const size_t staging_bytes_;
  bool connected_once_ = false;
  std::string staging_dir_;  // the store's, where staging is used ("": not)
  absl::Mutex staging_mu_;
  std::shared_ptr<StagingRing> staging_ ABSL_GUARDED_BY(staging_mu_);
  std::string released_;  // the file it replaced, not yet let go (append-thread state)
  // The mapped arena (queue-thread state once the client is made).
  const uint8_t* arena_ = nullptr;
  size_t arena_bytes_ = 0;
  int64_t block_bytes_ = 0;
  uint64_t instance_ = 0;    // the run of the store whose arena is mapped
  uint64_t generation_ = 0;  // mappings made (KvStoreClient::Span::generation)
  // Queue-thread state.
  std::map<std::pair<StoreSequenceId, int>, StoreBlockTable> tables_;  // node-based: stable
  std::vector<CopyJob> copies_;
  std::unique_ptr<ThreadPool> pool_;  // copies of large gathers
  // Append-thread state read by gathers.
  absl::Mutex appended_mu_;
  absl::flat_hash_map<std::pair<StoreSequenceId, int>, int64_t> appended_
      ABSL_GUARDED_BY(appended_mu_);
};

}  // namespace

std::unique_ptr<KvDataPlane> MakeShmDataPlane(KvControlPlane& control,
                                              const KvClientConfig& config) {
  return std::make_unique<ShmDataPlane>(control, config);
}

}  // namespace infinigen
