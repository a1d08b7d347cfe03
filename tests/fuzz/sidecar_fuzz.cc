// libFuzzer target for the InfiniGen sidecar reader (ParseSidecar): arbitrary bytes as the
// sidecar file of a small model (2 layers, 2 KV heads of 8 channels, fingerprint "fuzz-model").
// Whatever the bytes, the reader returns an error, or a sidecar whose every layer has a skew of
// [kv_heads, d, d] and channels of [kv_heads, partial_dim] inside [0, d), from which the partial
// skew (what the speculation and the partial keys are built from) can be read; under ASan and
// UBSan. The seeds (scripts/fuzz.sh) are valid sidecars of that model, skewed and RoPE-pair.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "gpu_worker/infinigen/sidecar_file.h"
#include "tests/fuzz/fuzz_input_file.h"

namespace {

infinigen::ModelConfig SmallModel() {
  infinigen::ModelConfig c;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.hidden_size = 32;
  c.rope.rotary_dim = 8;
  return c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const infinigen::ModelConfig model = SmallModel();
  const std::string& path = WriteFuzzInputFile(data, size);
  auto file = infinigen::MappedFile::Open(path);
  if (!file.ok()) return 0;
  auto s = infinigen::ParseSidecar(*file, path, "fuzz-model", model, "model");
  if (!s.ok()) return 0;
  const size_t d = static_cast<size_t>(s->head_dim), kv = static_cast<size_t>(s->num_kv_heads);
  if (s->num_layers != model.num_layers || s->skew.size() != static_cast<size_t>(s->num_layers) ||
      s->channels.size() != s->skew.size() || s->partial_dim < 1 || s->partial_dim > s->head_dim) {
    __builtin_trap();
  }
  for (int l = 0; l < s->num_layers; ++l) {
    if (s->skew[l].size() != kv * d * d ||
        s->channels[l].size() != kv * static_cast<size_t>(s->partial_dim)) {
      __builtin_trap();
    }
    for (int32_t c : s->channels[l]) {
      if (c < 0 || c >= s->head_dim) __builtin_trap();
    }
    if (s->PartialSkew(l).size() != kv * d * static_cast<size_t>(s->partial_dim)) {
      __builtin_trap();
    }
  }
  return 0;
}
