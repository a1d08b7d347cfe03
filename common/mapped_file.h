// A read-only memory mapping of a whole file. Checkpoints are read through it so that their
// bytes are never held twice in RAM: the page cache is the only copy until a backend converts
// a tensor, after which the converted range can be dropped with DropPages().
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace infinigen {

class MappedFile {
 public:
  static absl::StatusOr<MappedFile> Open(const std::string& path);

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Tells the kernel that [offset, offset + length) will not be read again soon, so its page
  // cache pages may be reclaimed first. Purely advisory.
  void DropPages(size_t offset, size_t length) const;

 private:
  void Reset();

  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace infinigen
