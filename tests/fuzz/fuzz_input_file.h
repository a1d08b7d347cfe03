// A fuzz input as a file, for readers that take paths: written to tmpfs (kept in memory), one
// file per process, overwritten by each input.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

inline const std::string& WriteFuzzInputFile(const uint8_t* data, size_t size) {
  static const std::string path = "/dev/shm/infinigen_fuzz_" + std::to_string(getpid());
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) __builtin_trap();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) __builtin_trap();
  std::fclose(f);
  return path;
}
