#include "gpu_worker/infinigen/sidecar.h"

#include <filesystem>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/mapped_file.h"
#include "common/status_macros.h"
#include "gpu_worker/model/safetensors.h"

namespace infinigen {

PartialChannels PartialChannelsOf(const InfinigenSidecar& s) {
  PartialChannels pc;
  pc.partial_dim = s.partial_dim;
  pc.skewed = s.skewed;
  pc.channels = s.channels;
  for (int l = 0; l < s.num_layers; ++l) pc.partial_skew.push_back(s.PartialSkew(l));
  return pc;
}

absl::Status AttachSidecar(Model& model, const Checkpoint& checkpoint,
                           const InfinigenSidecar& sidecar) {
  return model.AttachSpeculation(checkpoint, PartialChannelsOf(sidecar));
}

std::string Fnv1aHex(const void* data, size_t bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return absl::StrFormat("%016x", h);
}

std::string ModelFingerprint(const Checkpoint& ckpt) {
  const ModelConfig& c = ckpt.config();
  std::string key = absl::StrCat(c.architecture == Architecture::kLlama ? "llama" : "opt", ":",
                                 c.num_layers, ":", c.hidden_size, ":", c.num_heads, ":",
                                 c.num_kv_heads, ":", c.head_dim, ":", c.vocab_size, ":");
  const char* q_name = c.architecture == Architecture::kLlama
                           ? "model.layers.0.self_attn.q_proj.weight"
                           : "model.decoder.layers.0.self_attn.q_proj.weight";
  if (const StoredTensor* t = ckpt.Find(q_name); t != nullptr) {
    absl::StrAppend(&key, Fnv1aHex(t->data, static_cast<size_t>(t->num_bytes)));
  }
  return Fnv1aHex(key.data(), key.size());
}

std::string DefaultSidecarPath(const std::string& model_path) {
  std::error_code ec;
  if (std::filesystem::is_directory(model_path, ec)) {
    return (std::filesystem::path(model_path) / "infinigen.safetensors").string();
  }
  return model_path + ".infinigen.safetensors";
}

absl::StatusOr<InfinigenSidecar> ReadSidecar(const std::string& path, const Checkpoint& model) {
  IG_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path));
  return ParseSidecar(file, path, ModelFingerprint(model), model.config(), model.path());
}

}  // namespace infinigen
