// A GGUF written the way llama.cpp's converter writes one (Q/K rows permuted for interleaved
// RoPE, llama3 scaling as a rope_freqs tensor), from the Llama-3.1-like fixture: its logits must
// equal transformers' on the original safetensors checkpoint.
#include <gtest/gtest.h>

#include <filesystem>

#include "common/npy.h"
#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/model.h"
#include "tests/support/gguf_writer.h"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

// llama.cpp's permutation: within each head, row i of the first half goes to 2i and row i of
// the second half to 2i + 1, so that RoPE's pairs become adjacent.
std::vector<float> PermuteForInterleavedRope(const std::vector<float>& w, int64_t heads,
                                             int64_t head_dim, int64_t cols) {
  std::vector<float> out(w.size());
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < head_dim / 2; ++i) {
      for (int64_t part = 0; part < 2; ++part) {
        const int64_t src = h * head_dim + i + part * head_dim / 2;
        const int64_t dst = h * head_dim + 2 * i + part;
        std::copy_n(w.begin() + src * cols, cols, out.begin() + dst * cols);
      }
    }
  }
  return out;
}

TEST(GgufModel, ConvertedFixtureMatchesTransformersLogits) {
  const std::string dir = testing::FixturePath("hf/llama31_gqa");
  auto hf = Checkpoint::Open(dir);
  ASSERT_TRUE(hf.ok()) << hf.status();
  const ModelConfig& c = (*hf)->config();
  auto read = [&](const std::string& name, std::vector<int64_t> shape) {
    auto v = (*hf)->ReadFloat(name, shape);
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? *v : std::vector<float>(1);
  };

  testing::GgufWriter w;
  w.AddString("general.architecture", "llama");
  w.AddU32("llama.block_count", c.num_layers);
  w.AddU32("llama.embedding_length", c.hidden_size);
  w.AddU32("llama.feed_forward_length", c.intermediate_size);
  w.AddU32("llama.attention.head_count", c.num_heads);
  w.AddU32("llama.attention.head_count_kv", c.num_kv_heads);
  w.AddU32("llama.context_length", c.max_position_embeddings);
  w.AddU32("llama.rope.dimension_count", c.head_dim);
  w.AddF32("llama.rope.freq_base", static_cast<float>(c.rope.theta));
  w.AddF32("llama.attention.layer_norm_rms_epsilon", c.norm_eps);
  w.AddF32Tensor("token_embd.weight", {c.vocab_size, c.hidden_size},
                 read("model.embed_tokens.weight", {c.vocab_size, c.hidden_size}));
  w.AddF32Tensor("output.weight", {c.vocab_size, c.hidden_size},
                 read("lm_head.weight", {c.vocab_size, c.hidden_size}));
  w.AddF32Tensor("output_norm.weight", {c.hidden_size}, read("model.norm.weight", {c.hidden_size}));
  RopeConfig plain = c.rope;
  plain.scaling = RopeScaling::kNone;
  auto base = RopeInverseFrequencies(plain), scaled = RopeInverseFrequencies(c.rope);
  std::vector<float> factors(base.size());
  for (size_t i = 0; i < base.size(); ++i) factors[i] = base[i] / scaled[i];
  w.AddF32Tensor("rope_freqs.weight", {static_cast<int64_t>(factors.size())}, factors);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const std::string b = "blk." + std::to_string(l) + ".";
    w.AddF32Tensor(b + "attn_norm.weight", {c.hidden_size},
                   read(p + "input_layernorm.weight", {c.hidden_size}));
    w.AddF32Tensor(b + "ffn_norm.weight", {c.hidden_size},
                   read(p + "post_attention_layernorm.weight", {c.hidden_size}));
    w.AddF32Tensor(
        b + "attn_q.weight", {c.q_dim(), c.hidden_size},
        PermuteForInterleavedRope(read(p + "self_attn.q_proj.weight", {c.q_dim(), c.hidden_size}),
                                  c.num_heads, c.head_dim, c.hidden_size));
    w.AddF32Tensor(
        b + "attn_k.weight", {c.kv_dim(), c.hidden_size},
        PermuteForInterleavedRope(read(p + "self_attn.k_proj.weight", {c.kv_dim(), c.hidden_size}),
                                  c.num_kv_heads, c.head_dim, c.hidden_size));
    w.AddF32Tensor(b + "attn_v.weight", {c.kv_dim(), c.hidden_size},
                   read(p + "self_attn.v_proj.weight", {c.kv_dim(), c.hidden_size}));
    w.AddF32Tensor(b + "attn_output.weight", {c.hidden_size, c.q_dim()},
                   read(p + "self_attn.o_proj.weight", {c.hidden_size, c.q_dim()}));
    for (auto [g, h] : {std::pair{"ffn_gate", "gate_proj"}, {"ffn_up", "up_proj"}}) {
      w.AddF32Tensor(b + g + ".weight", {c.intermediate_size, c.hidden_size},
                     read(p + "mlp." + h + ".weight", {c.intermediate_size, c.hidden_size}));
    }
    w.AddF32Tensor(b + "ffn_down.weight", {c.hidden_size, c.intermediate_size},
                   read(p + "mlp.down_proj.weight", {c.hidden_size, c.intermediate_size}));
  }
  const std::string path =
      (std::filesystem::temp_directory_path() / "infinigen_llama31_fixture.gguf").string();
  testing::WriteFile(path, w.Build());

  auto gguf = Checkpoint::Open(path);
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  EXPECT_EQ((*gguf)->config().rope.layout, cpu::RopeLayout::kInterleaved);
  CpuBackend backend;
  auto model = Model::Load(**gguf, backend);
  ASSERT_TRUE(model.ok()) << model.status();
  auto tokens = testing::NpyInts(dir + "/tokens.npy");
  auto want = testing::NpyFloats(dir + "/logits.npy");
  BackendKvCache cache(backend, (*model)->kv_shape());
  ASSERT_TRUE(cache.Open(1, 32).ok());
  std::vector<float> logits(tokens.size() * c.vocab_size);
  ForwardChunk chunk{1, 0, tokens, true};
  ASSERT_TRUE(DecodeStep(**model, cache).Forward({&chunk, 1}, logits).ok());
  float max_diff = 0;
  for (size_t i = 0; i < logits.size(); ++i)
    max_diff = std::max(max_diff, std::abs(logits[i] - want[i]));
  EXPECT_LE(max_diff, 1e-4f);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace infinigen
