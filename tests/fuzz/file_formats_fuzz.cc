// libFuzzer targets for the checkpoint and array readers: arbitrary bytes as a GGUF file, a
// safetensors file or a .npy file (one target each, picked by INFINIGEN_FUZZ_FORMAT at compile
// time). Whatever the bytes, the reader returns an error or a result whose every tensor lies
// inside the file and holds exactly the bytes its type and shape need; small tensors are decoded
// (under ASan and UBSan). A memory-mapped file is not ASan-instrumented, so these bounds are
// checked explicitly: an out-of-bounds tensor would otherwise read neighbouring pages silently.
// scripts/fuzz.sh builds them with clang and runs each for a bounded time.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "common/mapped_file.h"
#include "common/npy.h"
#include "gpu_worker/model/gguf.h"
#include "gpu_worker/model/safetensors.h"
#include "gpu_worker/model/stored_tensor.h"
#include "tests/fuzz/fuzz_input_file.h"

namespace {

// Every tensor inside the file, its byte count what its type and shape need; small ones decoded.
void CheckTensors(const infinigen::MappedFile& file,
                  const std::vector<infinigen::StoredTensor>& tensors) {
  const uint8_t* begin = file.data();
  const uint8_t* end = begin + file.size();
  for (const infinigen::StoredTensor& t : tensors) {
    if (t.num_bytes < 0 || t.data < begin || t.data > end || t.num_bytes > end - t.data) {
      __builtin_trap();  // a tensor past the end of the file
    }
    const auto bytes = infinigen::StorageBytes(t.type, t.NumElements());
    if (!bytes.ok() || *bytes != t.num_bytes) __builtin_trap();  // bytes and shape disagree
    if (t.NumElements() <= (1 << 16)) {
      std::vector<float> out(static_cast<size_t>(t.NumElements()));
      infinigen::DecodeToFloat(t, out.data());
    }
    (void)t.ShapeString();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = WriteFuzzInputFile(data, size);
#if INFINIGEN_FUZZ_FORMAT == 1  // GGUF
  auto file = infinigen::MappedFile::Open(path);
  if (!file.ok()) return 0;
  auto gguf = infinigen::GgufFile::Parse(*file);
  if (!gguf.ok()) return 0;
  CheckTensors(*file, gguf->tensors);
  for (const auto& [key, value] : gguf->metadata) {
    (void)gguf->IntOr(key, 0);
    (void)gguf->FloatOr(key, 0.0);
    (void)gguf->StringOr(key, "");
  }
  (void)infinigen::GgufModelConfig(*gguf, path);  // any metadata: a config or an error
#elif INFINIGEN_FUZZ_FORMAT == 2                  // safetensors
  auto file = infinigen::MappedFile::Open(path);
  if (!file.ok()) return 0;
  std::vector<infinigen::StoredTensor> tensors;
  std::map<std::string, std::string> metadata;
  if (!infinigen::ParseSafetensors(*file, tensors, &metadata).ok()) return 0;
  CheckTensors(*file, tensors);
#elif INFINIGEN_FUZZ_FORMAT == 3                  // .npy
  auto array = infinigen::ReadNpy(path);
  if (!array.ok()) return 0;
  int64_t elements = 1;
  for (int64_t d : array->shape) elements *= d;
  if (elements != array->NumElements()) __builtin_trap();
  (void)array->AsFloat();
  (void)array->AsInt();
#else
#error "INFINIGEN_FUZZ_FORMAT: 1 (GGUF), 2 (safetensors) or 3 (npy)"
#endif
  return 0;
}
