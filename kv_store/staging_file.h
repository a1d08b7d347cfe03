// Staging files: how a collocated client (the shm transport) hands its appends' rows to the KV
// store process without sending them through protobuf and a socket (0.35 GB/s over gRPC on the
// project VM, against 23 GB/s for gathers out of the mapped arena: a 32K-token prompt of
// Llama-3.1-8B, 4 GiB of K/V, took seconds to land, and its first decode step waited for it).
// The client writes the rows of an AppendBatch into a file of its own beside the store's arena
// (StagingWriter), and the call carries their offsets; the store maps the file read-only
// (StagingFiles) and copies the rows into its arena. The store advertises the folder
// (Describe's staging_dir: the arena's, which both processes see).
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace infinigen {

// Staging files are named this, then [A-Za-z0-9-]+, in the store's staging folder.
inline constexpr char kStagingFilePrefix[] = "infinigen-staging-";

// The client's file: created (0600, under a name no other client has) and mapped for writing;
// unmapped (and unlinked if still named) when destroyed (a store that mapped it keeps reading
// its mapping).
class StagingWriter {
 public:
  static absl::StatusOr<std::unique_ptr<StagingWriter>> Create(const std::string& dir,
                                                               size_t bytes);
  ~StagingWriter();
  StagingWriter(const StagingWriter&) = delete;
  StagingWriter& operator=(const StagingWriter&) = delete;

  const std::string& path() const { return path_; }
  uint8_t* data() { return data_; }
  size_t size() const { return size_; }
  // Removes the file's name once the store has mapped it (its first call through the file went
  // through): nothing is left behind if this process dies, and the store keeps its mapping. A
  // store that no longer has it mapped then refuses the path (NOT_FOUND): the client sends the
  // rows in the call and stages in a new file.
  void Unlink();
  bool unlinked() const { return unlinked_; }

 private:
  StagingWriter(std::string path, uint8_t* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  const std::string path_;
  uint8_t* const data_;
  const size_t size_;
  bool unlinked_ = false;
};

// One staging file mapped read-only in the store.
class StagingMapping {
 public:
  StagingMapping(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  ~StagingMapping();
  StagingMapping(const StagingMapping&) = delete;
  StagingMapping& operator=(const StagingMapping&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const uint8_t* const data_;
  const size_t size_;
};

// The store's mapped staging files, by path: the most recently used kMaxFiles are kept (a
// mapping in use by a call lives until the call ends). Thread-safe.
class StagingFiles {
 public:
  // `dir`: the folder clients may name files in (empty: none may).
  explicit StagingFiles(std::string dir) : dir_(std::move(dir)) {}
  const std::string& dir() const { return dir_; }
  // The file at `path`, mapped: INVALID_ARGUMENT for a path that is not a staging file of
  // dir() (what a client must send), NOT_FOUND when it cannot be opened or mapped (or is not a
  // regular file of this process's user: no link, FIFO or another user's file).
  absl::StatusOr<std::shared_ptr<const StagingMapping>> Map(const std::string& path);
  // Forgets `path`'s mapping (its client moved to another file); a call using it keeps it.
  void Release(const std::string& path);
  static constexpr size_t kMaxFiles = 64;

 private:
  const std::string dir_;
  absl::Mutex mu_;
  // Most recently used first.
  std::list<std::pair<std::string, std::shared_ptr<const StagingMapping>>> files_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace infinigen
