#include "gpu_worker/model/config.h"

#include <cmath>
#include <numbers>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace infinigen {
namespace {

using json = nlohmann::json;

absl::Status Bad(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

// Reads an integer field; `fallback` < 0 means the field is required.
absl::StatusOr<int64_t> Int(const json& j, const char* key, const std::string& path,
                            int64_t fallback = -1) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (fallback >= 0) return fallback;
    return Bad(path, absl::StrCat("missing required field \"", key, "\""));
  }
  if (!it->is_number_integer()) return Bad(path, absl::StrCat("\"", key, "\" must be an integer"));
  return it->get<int64_t>();
}

double Number(const json& j, const char* key, double fallback) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : fallback;
}

bool Bool(const json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  return it != j.end() && it->is_boolean() ? it->get<bool>() : fallback;
}

std::vector<int32_t> TokenIds(const json& j, const char* key) {
  std::vector<int32_t> ids;
  auto it = j.find(key);
  if (it == j.end()) return ids;
  if (it->is_number_integer()) ids.push_back(it->get<int32_t>());
  if (it->is_array()) {
    for (const auto& v : *it) {
      if (v.is_number_integer()) ids.push_back(v.get<int32_t>());
    }
  }
  return ids;
}

absl::Status ParseRopeScaling(const json& j, const std::string& path, RopeConfig& rope) {
  auto it = j.find("rope_scaling");
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_object()) return Bad(path, "\"rope_scaling\" must be an object or null");
  std::string type;
  if (it->contains("rope_type"))
    type = (*it)["rope_type"].get<std::string>();
  else if (it->contains("type"))
    type = (*it)["type"].get<std::string>();
  if (type.empty() || type == "default") return absl::OkStatus();
  rope.factor = Number(*it, "factor", 1.0);
  if (!(rope.factor > 0)) return Bad(path, "rope_scaling.factor must be > 0");
  if (type == "linear") {
    rope.scaling = RopeScaling::kLinear;
  } else if (type == "llama3") {
    rope.scaling = RopeScaling::kLlama3;
    rope.low_freq_factor = Number(*it, "low_freq_factor", 1.0);
    rope.high_freq_factor = Number(*it, "high_freq_factor", 4.0);
    auto orig = Int(*it, "original_max_position_embeddings", path, 8192);
    if (!orig.ok()) return orig.status();
    rope.original_max_position_embeddings = *orig;
    if (!(rope.high_freq_factor > rope.low_freq_factor)) {
      return Bad(path, "rope_scaling: high_freq_factor must exceed low_freq_factor");
    }
  } else {
    return Bad(path, absl::StrCat("rope_scaling type \"", type,
                                  "\" is not supported (supported: default, linear, llama3)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ParseLlama(const json& j, const std::string& path) {
  ModelConfig c;
  c.architecture = Architecture::kLlama;
  auto vocab = Int(j, "vocab_size", path);
  auto hidden = Int(j, "hidden_size", path);
  auto inter = Int(j, "intermediate_size", path);
  auto layers = Int(j, "num_hidden_layers", path);
  auto heads = Int(j, "num_attention_heads", path);
  for (auto* s : {&vocab, &hidden, &inter, &layers, &heads}) {
    if (!s->ok()) return s->status();
  }
  c.vocab_size = *vocab;
  c.hidden_size = *hidden;
  c.intermediate_size = *inter;
  c.num_layers = *layers;
  c.num_heads = *heads;
  auto kv = Int(j, "num_key_value_heads", path, c.num_heads);
  if (!kv.ok()) return kv.status();
  c.num_kv_heads = *kv;
  auto head_dim = Int(j, "head_dim", path, c.num_heads > 0 ? c.hidden_size / c.num_heads : 0);
  if (!head_dim.ok()) return head_dim.status();
  c.head_dim = *head_dim;
  auto max_pos = Int(j, "max_position_embeddings", path, 2048);
  if (!max_pos.ok()) return max_pos.status();
  c.max_position_embeddings = *max_pos;
  c.norm_eps = static_cast<float>(Number(j, "rms_norm_eps", 1e-6));
  std::string act = j.value("hidden_act", "silu");
  if (act != "silu") return Bad(path, absl::StrCat("hidden_act \"", act, "\" is not supported"));
  c.activation = Activation::kSilu;
  c.tie_word_embeddings = Bool(j, "tie_word_embeddings", false);
  c.attention_bias = Bool(j, "attention_bias", false);
  c.mlp_bias = Bool(j, "mlp_bias", false);
  c.rope.theta = Number(j, "rope_theta", 10000.0);
  c.rope.rotary_dim = static_cast<int>(c.head_dim);
  c.rope.layout = cpu::RopeLayout::kHalf;
  if (auto st = ParseRopeScaling(j, path, c.rope); !st.ok()) return st;
  return c;
}

absl::StatusOr<ModelConfig> ParseOpt(const json& j, const std::string& path) {
  ModelConfig c;
  c.architecture = Architecture::kOpt;
  auto vocab = Int(j, "vocab_size", path);
  auto hidden = Int(j, "hidden_size", path);
  auto ffn = Int(j, "ffn_dim", path);
  auto layers = Int(j, "num_hidden_layers", path);
  auto heads = Int(j, "num_attention_heads", path);
  for (auto* s : {&vocab, &hidden, &ffn, &layers, &heads}) {
    if (!s->ok()) return s->status();
  }
  c.vocab_size = *vocab;
  c.hidden_size = *hidden;
  c.intermediate_size = *ffn;
  c.num_layers = *layers;
  c.num_heads = *heads;
  c.num_kv_heads = c.num_heads;
  c.head_dim = c.num_heads > 0 ? c.hidden_size / c.num_heads : 0;
  auto max_pos = Int(j, "max_position_embeddings", path, 2048);
  if (!max_pos.ok()) return max_pos.status();
  c.max_position_embeddings = *max_pos;
  auto proj = Int(j, "word_embed_proj_dim", path, c.hidden_size);
  if (!proj.ok()) return proj.status();
  c.word_embed_proj_dim = *proj;
  std::string act = j.value("activation_function", "relu");
  if (act != "relu") {
    return Bad(path, absl::StrCat("activation_function \"", act, "\" is not supported (relu)"));
  }
  if (!Bool(j, "layer_norm_elementwise_affine", true)) {
    return Bad(path, "layer_norm_elementwise_affine = false is not supported");
  }
  c.activation = Activation::kRelu;
  c.norm_eps = 1e-5f;
  c.pre_norm = Bool(j, "do_layer_norm_before", true);
  c.final_norm = c.pre_norm && !Bool(j, "_remove_final_layer_norm", false);
  c.attention_bias = c.mlp_bias = Bool(j, "enable_bias", true);
  c.tie_word_embeddings = Bool(j, "tie_word_embeddings", true);
  return c;
}

}  // namespace

absl::Status ModelConfig::Validate(const std::string& source) const {
  auto positive = [&](const char* what, int64_t v) -> absl::Status {
    if (v > 0) return absl::OkStatus();
    return Bad(source, absl::StrCat(what, " must be > 0, got ", v));
  };
  for (auto [what, v] : {std::pair<const char*, int64_t>{"vocab_size", vocab_size},
                         {"hidden_size", hidden_size},
                         {"intermediate_size", intermediate_size},
                         {"num_layers", num_layers},
                         {"num_heads", num_heads},
                         {"num_kv_heads", num_kv_heads},
                         {"head_dim", head_dim},
                         {"max_position_embeddings", max_position_embeddings}}) {
    if (auto st = positive(what, v); !st.ok()) return st;
  }
  if (num_heads % num_kv_heads != 0) {
    return Bad(source, absl::StrCat("num_heads (", num_heads,
                                    ") is not a multiple of num_kv_heads (", num_kv_heads, ")"));
  }
  if (architecture == Architecture::kOpt) {
    if (num_heads * head_dim != hidden_size) {
      return Bad(source, absl::StrCat("hidden_size ", hidden_size, " is not divisible by ",
                                      num_heads, " heads"));
    }
    if (word_embed_proj_dim <= 0) return Bad(source, "word_embed_proj_dim must be > 0");
  } else {
    if (rope.rotary_dim <= 0 || rope.rotary_dim > head_dim || rope.rotary_dim % 2 != 0) {
      return Bad(source, absl::StrCat("rotary dimension ", rope.rotary_dim,
                                      " must be even and in (0, head_dim = ", head_dim, "]"));
    }
    if (!(rope.theta > 0)) return Bad(source, "rope_theta must be > 0");
  }
  if (!(norm_eps > 0)) return Bad(source, "norm epsilon must be > 0");
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ParseHfConfig(const std::string& json_text, const std::string& path) {
  json j = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Bad(path, "not a JSON object");
  std::string model_type = j.value("model_type", "");
  absl::StatusOr<ModelConfig> config;
  try {
    if (model_type == "llama") {
      config = ParseLlama(j, path);
    } else if (model_type == "opt") {
      config = ParseOpt(j, path);
    } else {
      return Bad(path, absl::StrCat("model_type \"", model_type,
                                    "\" is not supported (supported: llama, opt)"));
    }
  } catch (const json::exception& e) {
    return Bad(path, absl::StrCat("malformed field: ", e.what()));
  }
  if (!config.ok()) return config.status();
  config->name = j.value("_name_or_path", model_type);
  auto bos = TokenIds(j, "bos_token_id");
  if (!bos.empty()) config->bos_token_id = bos[0];
  config->eos_token_ids = TokenIds(j, "eos_token_id");
  if (auto st = config->Validate(path); !st.ok()) return st;
  return config;
}

std::vector<float> RopeInverseFrequencies(const RopeConfig& rope,
                                          const std::vector<float>& freq_factors) {
  const int half = rope.rotary_dim / 2;
  std::vector<float> inv(half);
  const float base = static_cast<float>(rope.theta);
  for (int i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(rope.rotary_dim);
    inv[i] = 1.0f / std::pow(base, exponent);
  }
  const float factor = static_cast<float>(rope.factor);
  if (rope.scaling == RopeScaling::kLinear) {
    for (float& f : inv) f /= factor;
  } else if (rope.scaling == RopeScaling::kLlama3) {
    const float old_ctx = static_cast<float>(rope.original_max_position_embeddings);
    const float low = static_cast<float>(rope.low_freq_factor);
    const float high = static_cast<float>(rope.high_freq_factor);
    const float low_freq_wavelen = old_ctx / low;
    const float high_freq_wavelen = old_ctx / high;
    for (float& f : inv) {
      const float wavelen = 2.0f * std::numbers::pi_v<float> / f;
      float scaled = wavelen > low_freq_wavelen ? f / factor : f;
      if (!(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen)) {
        const float smooth = (old_ctx / wavelen - low) / (high - low);
        scaled = (1.0f - smooth) * scaled / factor + smooth * scaled;
      }
      f = scaled;
    }
  }
  if (!freq_factors.empty()) {
    for (int i = 0; i < half && i < static_cast<int>(freq_factors.size()); ++i) {
      inv[i] /= freq_factors[i];
    }
  }
  return inv;
}

}  // namespace infinigen
