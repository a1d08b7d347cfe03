// The shape and hyper-parameters of a checkpoint, whatever file it came from.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cpu/ops.h"

namespace infinigen {

enum class Architecture { kLlama, kOpt };
enum class Activation { kSilu, kRelu };
enum class RopeScaling { kNone, kLinear, kLlama3 };

struct RopeConfig {
  double theta = 10000.0;
  RopeScaling scaling = RopeScaling::kNone;
  double factor = 1.0;                              // linear and llama3
  double low_freq_factor = 1.0;                     // llama3
  double high_freq_factor = 4.0;                    // llama3
  int64_t original_max_position_embeddings = 8192;  // llama3
  cpu::RopeLayout layout = cpu::RopeLayout::kHalf;
  int rotary_dim = 0;  // channels rotated per head (= head_dim for Llama)
};

struct ModelConfig {
  Architecture architecture = Architecture::kLlama;
  std::string name;  // for logs and model info
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  float norm_eps = 1e-5f;
  Activation activation = Activation::kSilu;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v/o biases (OPT: enable_bias)
  bool mlp_bias = false;        // MLP biases (OPT: enable_bias)
  RopeConfig rope;              // Llama family only

  // OPT only.
  bool pre_norm = true;             // do_layer_norm_before
  bool final_norm = true;           // decoder-level final LayerNorm present
  int64_t word_embed_proj_dim = 0;  // != hidden_size: project_in/out exist
  int64_t position_offset = 2;      // learned position p is row p + offset

  int32_t bos_token_id = -1;
  std::vector<int32_t> eos_token_ids;

  int64_t q_dim() const { return num_heads * head_dim; }
  int64_t kv_dim() const { return num_kv_heads * head_dim; }
  int64_t embed_dim() const {
    return architecture == Architecture::kOpt ? word_embed_proj_dim : hidden_size;
  }
  bool has_projections() const {
    return architecture == Architecture::kOpt && word_embed_proj_dim != hidden_size;
  }

  // Internal consistency (positive sizes, heads divide, ...). `source` names the file.
  absl::Status Validate(const std::string& source) const;
};

// Parses a Hugging Face config.json (LlamaForCausalLM, MistralForCausalLM-style Llama, or
// OPTForCausalLM). `path` is used in error messages.
absl::StatusOr<ModelConfig> ParseHfConfig(const std::string& json_text, const std::string& path);

// The per-pair inverse frequencies (rotary_dim / 2 values) that RoPE turns by, with the
// configured scaling applied, computed in float32 as Hugging Face does. `freq_factors`, when
// not empty, divides each frequency (GGUF rope_freqs.weight).
std::vector<float> RopeInverseFrequencies(const RopeConfig& rope,
                                          const std::vector<float>& freq_factors = {});

}  // namespace infinigen
