#include "gpu_worker/model/weights.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu_worker/model/stacked_tensors.h"

namespace infinigen {
namespace {

// Reads tensors from a checkpoint and uploads them, stacking several into one when asked.
class Loader {
 public:
  Loader(const Checkpoint& ckpt, Backend& backend) : ckpt_(ckpt), backend_(backend) {}

  struct Part {
    std::string name;
    std::vector<int64_t> shape;
  };

  // Uploads `parts`, one after another, as a [rows, cols] matrix; the file's pages are released
  // once the backend has its copy.
  absl::StatusOr<Weight> Upload(const std::vector<Part>& parts, int64_t rows, int64_t cols) {
    std::vector<const StoredTensor*> tensors;
    for (const Part& part : parts) {
      IG_ASSIGN_OR_RETURN(const StoredTensor* t, ckpt_.Get(part.name, part.shape));
      tensors.push_back(t);
    }
    auto weight = backend_.UploadStoredWeight(StackedTensors(tensors, rows, cols));
    for (const StoredTensor* t : tensors) ckpt_.DropPages(*t);
    return weight;
  }

  absl::StatusOr<Weight> Matrix(const std::string& name, int64_t rows, int64_t cols) {
    return Upload({{name, {rows, cols}}}, rows, cols);
  }
  absl::StatusOr<Weight> Vector(const std::string& name, int64_t n) {
    return Upload({{name, {n}}}, 1, n);
  }
  // Matrices [rows[i], cols] stacked along rows.
  absl::StatusOr<Weight> StackedMatrices(const std::vector<std::string>& names,
                                         const std::vector<int64_t>& rows, int64_t cols) {
    std::vector<Part> parts;
    int64_t total = 0;
    for (size_t i = 0; i < names.size(); ++i) {
      parts.push_back({names[i], {rows[i], cols}});
      total += rows[i];
    }
    return Upload(parts, total, cols);
  }
  // Vectors [sizes[i]] concatenated.
  absl::StatusOr<Weight> ConcatenatedVectors(const std::vector<std::string>& names,
                                             const std::vector<int64_t>& sizes) {
    std::vector<Part> parts;
    int64_t total = 0;
    for (size_t i = 0; i < names.size(); ++i) {
      parts.push_back({names[i], {sizes[i]}});
      total += sizes[i];
    }
    return Upload(parts, 1, total);
  }

 private:
  const Checkpoint& ckpt_;
  Backend& backend_;
};

absl::Status LoadLlama(const Checkpoint& ckpt, Backend& backend, ModelWeights& w) {
  const ModelConfig& c = ckpt.config();
  Loader load(ckpt, backend);
  IG_ASSIGN_OR_RETURN(w.embed,
                      load.Matrix("model.embed_tokens.weight", c.vocab_size, c.hidden_size));
  IG_ASSIGN_OR_RETURN(w.final_norm, load.Vector("model.norm.weight", c.hidden_size));
  if (!c.tie_word_embeddings) {
    IG_ASSIGN_OR_RETURN(w.lm_head, load.Matrix("lm_head.weight", c.vocab_size, c.hidden_size));
  }
  std::vector<float> freq_factors;
  if (ckpt.Find("rope_freqs.weight") != nullptr) {
    IG_ASSIGN_OR_RETURN(freq_factors, ckpt.ReadFloat("rope_freqs.weight", {c.rope.rotary_dim / 2}));
  }
  const std::vector<float> inv_freq = RopeInverseFrequencies(c.rope, freq_factors);
  IG_ASSIGN_OR_RETURN(w.rope_inv_freq, backend.Allocate(inv_freq.size() * sizeof(float)));
  IG_RETURN_IF_ERROR(backend.CopyToDevice(inv_freq.data(), w.rope_inv_freq->data(),
                                          inv_freq.size() * sizeof(float)));

  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    LayerWeights& L = w.layers.emplace_back();
    IG_ASSIGN_OR_RETURN(L.attn_norm, load.Vector(p + "input_layernorm.weight", c.hidden_size));
    IG_ASSIGN_OR_RETURN(L.mlp_norm,
                        load.Vector(p + "post_attention_layernorm.weight", c.hidden_size));
    const std::string a = p + "self_attn.";
    IG_ASSIGN_OR_RETURN(
        L.qkv, load.StackedMatrices({a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"},
                                    {c.q_dim(), c.kv_dim(), c.kv_dim()}, c.hidden_size));
    IG_ASSIGN_OR_RETURN(L.o, load.Matrix(a + "o_proj.weight", c.hidden_size, c.q_dim()));
    if (c.attention_bias) {
      IG_ASSIGN_OR_RETURN(L.qkv_bias, load.ConcatenatedVectors(
                                          {a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"},
                                          {c.q_dim(), c.kv_dim(), c.kv_dim()}));
      IG_ASSIGN_OR_RETURN(L.o_bias, load.Vector(a + "o_proj.bias", c.hidden_size));
    }
    const std::string m = p + "mlp.";
    IG_ASSIGN_OR_RETURN(
        L.up, load.StackedMatrices({m + "gate_proj.weight", m + "up_proj.weight"},
                                   {c.intermediate_size, c.intermediate_size}, c.hidden_size));
    IG_ASSIGN_OR_RETURN(L.down,
                        load.Matrix(m + "down_proj.weight", c.hidden_size, c.intermediate_size));
    if (c.mlp_bias) {
      IG_ASSIGN_OR_RETURN(L.up_bias,
                          load.ConcatenatedVectors({m + "gate_proj.bias", m + "up_proj.bias"},
                                                   {c.intermediate_size, c.intermediate_size}));
      IG_ASSIGN_OR_RETURN(L.down_bias, load.Vector(m + "down_proj.bias", c.hidden_size));
    }
  }
  return absl::OkStatus();
}

absl::Status LoadOpt(const Checkpoint& ckpt, Backend& backend, ModelWeights& w) {
  const ModelConfig& c = ckpt.config();
  Loader load(ckpt, backend);
  const std::string d = "model.decoder.";
  IG_ASSIGN_OR_RETURN(w.embed,
                      load.Matrix(d + "embed_tokens.weight", c.vocab_size, c.word_embed_proj_dim));
  IG_ASSIGN_OR_RETURN(w.positions,
                      load.Matrix(d + "embed_positions.weight",
                                  c.max_position_embeddings + c.position_offset, c.hidden_size));
  if (c.has_projections()) {
    IG_ASSIGN_OR_RETURN(w.project_in,
                        load.Matrix(d + "project_in.weight", c.hidden_size, c.word_embed_proj_dim));
    IG_ASSIGN_OR_RETURN(
        w.project_out, load.Matrix(d + "project_out.weight", c.word_embed_proj_dim, c.hidden_size));
  }
  if (c.final_norm) {
    IG_ASSIGN_OR_RETURN(w.final_norm, load.Vector(d + "final_layer_norm.weight", c.hidden_size));
    IG_ASSIGN_OR_RETURN(w.final_norm_bias, load.Vector(d + "final_layer_norm.bias", c.hidden_size));
  }
  if (!c.tie_word_embeddings) {
    IG_ASSIGN_OR_RETURN(w.lm_head,
                        load.Matrix("lm_head.weight", c.vocab_size, c.word_embed_proj_dim));
  }
  const bool bias = c.attention_bias;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = absl::StrCat(d, "layers.", l, ".");
    LayerWeights& L = w.layers.emplace_back();
    IG_ASSIGN_OR_RETURN(L.attn_norm, load.Vector(p + "self_attn_layer_norm.weight", c.hidden_size));
    IG_ASSIGN_OR_RETURN(L.attn_norm_bias,
                        load.Vector(p + "self_attn_layer_norm.bias", c.hidden_size));
    IG_ASSIGN_OR_RETURN(L.mlp_norm, load.Vector(p + "final_layer_norm.weight", c.hidden_size));
    IG_ASSIGN_OR_RETURN(L.mlp_norm_bias, load.Vector(p + "final_layer_norm.bias", c.hidden_size));
    const std::string a = p + "self_attn.";
    IG_ASSIGN_OR_RETURN(
        L.qkv, load.StackedMatrices({a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"},
                                    {c.q_dim(), c.kv_dim(), c.kv_dim()}, c.hidden_size));
    IG_ASSIGN_OR_RETURN(L.o, load.Matrix(a + "out_proj.weight", c.hidden_size, c.q_dim()));
    if (bias) {
      IG_ASSIGN_OR_RETURN(L.qkv_bias, load.ConcatenatedVectors(
                                          {a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"},
                                          {c.q_dim(), c.kv_dim(), c.kv_dim()}));
      IG_ASSIGN_OR_RETURN(L.o_bias, load.Vector(a + "out_proj.bias", c.hidden_size));
    }
    IG_ASSIGN_OR_RETURN(L.up, load.Matrix(p + "fc1.weight", c.intermediate_size, c.hidden_size));
    IG_ASSIGN_OR_RETURN(L.down, load.Matrix(p + "fc2.weight", c.hidden_size, c.intermediate_size));
    if (c.mlp_bias) {
      IG_ASSIGN_OR_RETURN(L.up_bias, load.Vector(p + "fc1.bias", c.intermediate_size));
      IG_ASSIGN_OR_RETURN(L.down_bias, load.Vector(p + "fc2.bias", c.hidden_size));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelWeights> LoadWeights(const Checkpoint& ckpt, Backend& backend) {
  ModelWeights w;
  if (ckpt.config().architecture == Architecture::kLlama) {
    IG_RETURN_IF_ERROR(LoadLlama(ckpt, backend, w));
  } else {
    IG_RETURN_IF_ERROR(LoadOpt(ckpt, backend, w));
  }
  return w;
}

}  // namespace infinigen
