#include "kv_store/staging_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace infinigen {

absl::StatusOr<std::unique_ptr<StagingWriter>> StagingWriter::Create(const std::string& dir,
                                                                     size_t bytes) {
  static std::atomic<uint64_t> made{0};
  std::random_device rd;
  const uint64_t nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  const std::string path = absl::StrCat(dir, "/", kStagingFilePrefix, ::getpid(), "-", made++, "-",
                                        absl::StrFormat("%016x", nonce));
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create the append staging file ", path, ": ", std::strerror(errno)));
  }
  // Its pages taken now (a sparse file on a tmpfs that fills up would fault later, in a copy
  // into it): a folder without room gives no staging, and appends carry their rows.
  void* p = MAP_FAILED;
  int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err == 0) {
    p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) err = errno;
  }
  ::close(fd);
  if (p == MAP_FAILED) {
    ::unlink(path.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("cannot size or map the append staging file ",
                                                     path, " (", bytes,
                                                     " bytes): ", std::strerror(err)));
  }
  return std::unique_ptr<StagingWriter>(new StagingWriter(path, static_cast<uint8_t*>(p), bytes));
}

void StagingWriter::Unlink() {
  if (!unlinked_) ::unlink(path_.c_str());
  unlinked_ = true;
}

StagingWriter::~StagingWriter() {
  Unlink();
  ::munmap(data_, size_);
}

StagingMapping::~StagingMapping() { ::munmap(const_cast<uint8_t*>(data_), size_); }

absl::StatusOr<std::shared_ptr<const StagingMapping>> StagingFiles::Map(const std::string& path) {
  const std::string prefix = absl::StrCat(dir_, "/", kStagingFilePrefix);
  const bool named = !dir_.empty() && absl::StartsWith(path, prefix) &&
                     path.size() > prefix.size() && path.size() < prefix.size() + 128 &&
                     std::all_of(path.begin() + prefix.size(), path.end(), [](char c) {
                       return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-';
                     });
  if (!named) {
    return absl::InvalidArgumentError(
        dir_.empty()
            ? std::string("this KV store takes no staged appends (its arena is not shared)")
            : absl::StrCat("a staging file must be ", prefix, "[A-Za-z0-9-]+; got ", path));
  }
  {
    absl::MutexLock lock(&mu_);
    for (auto it = files_.begin(); it != files_.end(); ++it) {
      if (it->first != path) continue;
      files_.splice(files_.begin(), files_, it);
      return files_.front().second;
    }
  }
  // Opened and mapped outside the lock. Only a regular file of this process's user, not through
  // a link, and without blocking (a FIFO planted under the name would hold every call).
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(
        absl::StrCat("cannot open the staging file ", path, ": ", std::strerror(errno)));
  }
  struct stat st {};
  void* p = MAP_FAILED;
  int err = 0;
  if (::fstat(fd, &st) != 0) {
    err = errno;
  } else if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid() || st.st_size <= 0) {
    err = EPERM;
  } else {
    p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) err = errno;
  }
  ::close(fd);
  if (p == MAP_FAILED) {
    return absl::NotFoundError(
        absl::StrCat("cannot map the staging file ", path,
                     " (a regular file of the store's user): ", std::strerror(err)));
  }
  auto mapping = std::make_shared<const StagingMapping>(static_cast<const uint8_t*>(p),
                                                        static_cast<size_t>(st.st_size));
  absl::MutexLock lock(&mu_);
  // Another call may have mapped it meanwhile: one entry a path (this mapping goes with us).
  for (const auto& f : files_) {
    if (f.first == path) return f.second;
  }
  files_.emplace_front(path, mapping);
  if (files_.size() > kMaxFiles) files_.pop_back();
  return mapping;
}

void StagingFiles::Release(const std::string& path) {
  absl::MutexLock lock(&mu_);
  files_.remove_if([&](const auto& f) { return f.first == path; });
}

}  // namespace infinigen
