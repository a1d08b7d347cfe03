#include "gpu_worker/infinigen/sidecar_file.h"

#include <map>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu_worker/model/rope_pairs.h"
#include "gpu_worker/model/safetensors.h"
#include "gpu_worker/model/stored_tensor.h"

namespace infinigen {

namespace {

constexpr char kFormatName[] = "infinigen-sidecar";

std::string LayerName(int layer, const char* what) {
  return absl::StrCat("layers.", layer, ".", what);
}

}  // namespace

std::vector<float> InfinigenSidecar::PartialSkew(int layer) const {
  const int d = head_dim, p = partial_dim;
  std::vector<float> out(static_cast<size_t>(num_kv_heads) * d * p);
  for (int g = 0; g < num_kv_heads; ++g) {
    const float* a = skew[layer].data() + static_cast<size_t>(g) * d * d;
    const int32_t* ch = channels[layer].data() + static_cast<size_t>(g) * p;
    for (int r = 0; r < d; ++r) {
      for (int c = 0; c < p; ++c) out[(static_cast<size_t>(g) * d + r) * p + c] = a[r * d + ch[c]];
    }
  }
  return out;
}

absl::Status WriteSidecar(const InfinigenSidecar& s, const std::string& path) {
  std::map<std::string, std::string> meta = {
      {"format", kFormatName},
      {"version", absl::StrCat(InfinigenSidecar::kFormatVersion)},
      {"ratio", absl::StrCat(s.ratio)},
      {"partial_dim", absl::StrCat(s.partial_dim)},
      {"skewed", s.skewed ? "true" : "false"},
      {"rope_pairs", s.rope_pairs ? "true" : "false"},
      {"channel_rule", s.channel_rule},
      {"model_fingerprint", s.model_fingerprint},
      {"calibration_hash", s.calibration_hash},
      {"calibration_tokens", absl::StrCat(s.calibration_tokens)},
      {"num_layers", absl::StrCat(s.num_layers)},
      {"num_kv_heads", absl::StrCat(s.num_kv_heads)},
      {"head_dim", absl::StrCat(s.head_dim)},
  };
  std::vector<SafetensorsEntry> tensors;
  for (int l = 0; l < s.num_layers; ++l) {
    tensors.push_back({LayerName(l, "skew"), {s.num_kv_heads, s.head_dim, s.head_dim}, s.skew[l]});
    tensors.push_back({LayerName(l, "channels"),
                       {s.num_kv_heads, s.partial_dim},
                       std::vector<float>(s.channels[l].begin(), s.channels[l].end())});
  }
  return WriteSafetensors(path, tensors, meta);
}

absl::StatusOr<InfinigenSidecar> ParseSidecar(const MappedFile& file, const std::string& path,
                                              const std::string& fingerprint, const ModelConfig& c,
                                              const std::string& model_path) {
  std::vector<StoredTensor> tensors;
  std::map<std::string, std::string> meta;
  IG_RETURN_IF_ERROR(ParseSafetensors(file, tensors, &meta));
  auto bad = [&](const std::string& why) {
    return absl::FailedPreconditionError(absl::StrCat(path, ": ", why));
  };
  if (meta["format"] != kFormatName) return bad("not an InfiniGen sidecar");
  if (meta["version"] != absl::StrCat(InfinigenSidecar::kFormatVersion)) {
    return bad(absl::StrCat("sidecar format version ", meta["version"], ", this build reads ",
                            InfinigenSidecar::kFormatVersion, "; run `infinigen prepare` again"));
  }
  if (meta["model_fingerprint"] != fingerprint) {
    return bad(absl::StrCat("made for another model (fingerprint ", meta["model_fingerprint"],
                            ", this model is ", fingerprint, "); run `infinigen prepare --model ",
                            model_path, "`"));
  }
  InfinigenSidecar s;
  if (!absl::SimpleAtof(meta["ratio"], &s.ratio) ||
      !absl::SimpleAtoi(meta["partial_dim"], &s.partial_dim) ||
      !absl::SimpleAtoi(meta["calibration_tokens"], &s.calibration_tokens) ||
      !absl::SimpleAtoi(meta["num_layers"], &s.num_layers) ||
      !absl::SimpleAtoi(meta["num_kv_heads"], &s.num_kv_heads) ||
      !absl::SimpleAtoi(meta["head_dim"], &s.head_dim)) {
    return bad("malformed metadata");
  }
  s.skewed = meta["skewed"] == "true";
  s.rope_pairs = meta["rope_pairs"] == "true";  // absent in sidecars written before it existed
  s.channel_rule = meta["channel_rule"];        // absent in sidecars written before it was recorded
  s.model_fingerprint = fingerprint;
  s.calibration_hash = meta["calibration_hash"];
  if (s.num_layers != c.num_layers || s.num_kv_heads != c.num_kv_heads ||
      s.head_dim != c.head_dim || s.partial_dim <= 0 || s.partial_dim > s.head_dim) {
    return bad("shape does not match the model");
  }
  absl::flat_hash_map<std::string, const StoredTensor*> by_name;
  for (const auto& t : tensors) by_name[t.name] = &t;
  for (int l = 0; l < s.num_layers; ++l) {
    auto skew = by_name.find(LayerName(l, "skew"));
    auto ch = by_name.find(LayerName(l, "channels"));
    if (skew == by_name.end() || ch == by_name.end() ||
        skew->second->shape != std::vector<int64_t>{s.num_kv_heads, s.head_dim, s.head_dim} ||
        ch->second->shape != std::vector<int64_t>{s.num_kv_heads, s.partial_dim} ||
        skew->second->type != StorageType::kF32 || ch->second->type != StorageType::kF32) {
      return bad(absl::StrCat("layer ", l, " tensors are missing or have the wrong shape"));
    }
    std::vector<float> a(skew->second->NumElements()), channels(ch->second->NumElements());
    DecodeToFloat(*skew->second, a.data());
    DecodeToFloat(*ch->second, channels.data());
    s.skew.push_back(std::move(a));
    std::vector<int32_t> idx;
    for (float f : channels) {
      if (!(f >= 0 && f < s.head_dim))
        return bad(absl::StrCat("layer ", l, " channel out of range"));
      idx.push_back(static_cast<int32_t>(f));
    }
    s.channels.push_back(std::move(idx));
    if (s.rope_pairs &&
        (s.skewed || !IsRopePairOrder(s.channels.back(), s.num_kv_heads, s.partial_dim, s.head_dim,
                                      c.rope.rotary_dim, c.rope.layout))) {
      return bad(absl::StrCat("layer ", l,
                              " says rope_pairs but its channels are not whole RoPE "
                              "pairs of this model"));
    }
  }
  return s;
}

}  // namespace infinigen
