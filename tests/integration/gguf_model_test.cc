// A GGUF written the way llama.cpp's converter writes one (Q/K rows permuted for interleaved
// RoPE, llama3 scaling as a rope_freqs tensor), from the Llama-3.1-like fixture: its logits must
// equal transformers' on the original safetensors checkpoint. And a Llama GGUF in K-quants (and
// Q4_0) loads and computes on its own values.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <random>

#include "common/npy.h"
#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/model.h"
#include "gpu_worker/model/storage_type.h"
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

// Random blocks of `t` for n weights: any bytes are valid blocks once the f16 scales are finite
// (set to normal(0, scale) values).
std::vector<uint8_t> RandomBlocks(StorageType t, int64_t n, float scale, std::mt19937& rng) {
  static const std::map<StorageType, std::vector<int>> kHalfFields = {
      {StorageType::kQ4_0, {0}},   {StorageType::kQ4_K, {0, 2}}, {StorageType::kQ5_K, {0, 2}},
      {StorageType::kQ6_K, {208}}, {StorageType::kQ8_0, {0}},    {StorageType::kQ2_K, {80, 82}},
      {StorageType::kQ3_K, {108}}, {StorageType::kQ5_0, {0}},    {StorageType::kQ5_1, {0, 2}}};
  const int64_t blocks = n / StorageBlockElements(t), bytes = StorageBlockBytes(t);
  std::vector<uint8_t> out(blocks * bytes);
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> normal(0.0f, scale);
  for (auto& b : out) b = static_cast<uint8_t>(byte(rng));
  for (int64_t k = 0; k < blocks; ++k) {
    for (int off : kHalfFields.at(t)) {
      const uint16_t h = FloatToHalf(normal(rng));
      out[k * bytes + off] = h & 0xff;
      out[k * bytes + off + 1] = h >> 8;
    }
  }
  return out;
}

// The GGML type id of `t` (the inverse of StorageTypeOfGgml).
uint32_t GgmlId(StorageType t) {
  for (uint32_t id = 0; id < 64; ++id) {
    if (auto s = StorageTypeOfGgml(id); s.ok() && *s == t) return id;
  }
  ADD_FAILURE() << "no GGML id for " << StorageTypeName(t);
  return 0;
}

// Logits of `tokens` (all positions) of the model in `path` on a CPU backend.
std::vector<float> Logits(const std::string& path, const CpuBackendOptions& options,
                          const std::vector<int32_t>& tokens, std::string* backend_name) {
  auto ckpt = Checkpoint::Open(path);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  if (!ckpt.ok()) return {};
  CpuBackend backend(options);
  auto model = Model::Load(**ckpt, backend);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return {};
  *backend_name = backend.Name();
  BackendKvCache cache(backend, (*model)->kv_shape());
  EXPECT_TRUE(cache.Open(1, 64).ok());
  std::vector<float> logits(tokens.size() * (*ckpt)->config().vocab_size);
  ForwardChunk chunk{1, 0, tokens, true};
  EXPECT_TRUE(DecodeStep(**model, cache).Forward({&chunk, 1}, logits).ok());
  return logits;
}

TEST(GgufModel, KQuantModelRunsOnItsOwnValues) {
  // A Llama with rows of 256 and 512 weights (K-quants need multiples of 256): the attention and
  // embedding in Q4_K, gate and up in Q4_0 (layer 1's in Q5_0 and Q5_1), down in Q6_K, the
  // output in Q5_K, layer 1's down in Q2_K and its V in Q3_K, as a Q4_K_M-style file mixes them.
  const int64_t hidden = 256, inter = 512, heads = 4, kv_heads = 2, head_dim = 64, vocab = 512;
  std::mt19937 rng(7);
  testing::GgufWriter w;
  w.AddString("general.architecture", "llama");
  w.AddU32("llama.block_count", 2);
  w.AddU32("llama.embedding_length", hidden);
  w.AddU32("llama.feed_forward_length", inter);
  w.AddU32("llama.attention.head_count", heads);
  w.AddU32("llama.attention.head_count_kv", kv_heads);
  w.AddU32("llama.context_length", 256);
  w.AddU32("llama.rope.dimension_count", head_dim);
  w.AddF32("llama.rope.freq_base", 10000.0f);
  w.AddF32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  auto add = [&](const std::string& name, StorageType t, int64_t rows, int64_t cols) {
    w.AddTensor(name, {rows, cols}, GgmlId(t), RandomBlocks(t, rows * cols, 2e-3f, rng));
  };
  auto norm = [&](const std::string& name) {
    std::vector<float> v(hidden);
    std::normal_distribution<float> around_one(1.0f, 0.1f);
    for (float& x : v) x = around_one(rng);
    w.AddF32Tensor(name, {hidden}, v);
  };
  add("token_embd.weight", StorageType::kQ4_K, vocab, hidden);
  add("output.weight", StorageType::kQ5_K, vocab, hidden);
  norm("output_norm.weight");
  for (int l = 0; l < 2; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    norm(b + "attn_norm.weight");
    norm(b + "ffn_norm.weight");
    add(b + "attn_q.weight", StorageType::kQ4_K, heads * head_dim, hidden);
    add(b + "attn_k.weight", StorageType::kQ4_K, kv_heads * head_dim, hidden);
    add(b + "attn_v.weight", l == 1 ? StorageType::kQ3_K : StorageType::kQ4_K, kv_heads * head_dim,
        hidden);
    add(b + "attn_output.weight", StorageType::kQ4_K, hidden, heads * head_dim);
    add(b + "ffn_gate.weight", l == 1 ? StorageType::kQ5_0 : StorageType::kQ4_0, inter, hidden);
    add(b + "ffn_up.weight", l == 1 ? StorageType::kQ5_1 : StorageType::kQ4_0, inter, hidden);
    add(b + "ffn_down.weight", l == 1 ? StorageType::kQ2_K : StorageType::kQ6_K, hidden, inter);
  }
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("infinigen_kquant_" + std::to_string(::getpid()) + ".gguf"))
                               .string();
  testing::WriteFile(path, w.Build());

  std::vector<int32_t> tokens;
  for (int i = 0; i < 12; ++i) tokens.push_back((i * 97 + 5) % vocab);
  // The reference: every matrix decoded to float32 (the decoders equal the gguf package's,
  // tests/unit/gguf_quants_test.cc).
  std::string f32_name, q4_name;
  const std::vector<float> f32 = Logits(path, {}, tokens, &f32_name);
  CpuBackendOptions q4;
  q4.weight_format = WeightFormat::kQ4_1;
  const std::vector<float> kept = Logits(path, q4, tokens, &q4_name);
  std::filesystem::remove(path);
  ASSERT_EQ(f32.size(), tokens.size() * vocab);
  ASSERT_EQ(kept.size(), f32.size());
  EXPECT_EQ(q4_name, "cpu-q4_1");  // the 4- and 5-bit matrices were kept
  float max_abs = 0, max_diff = 0;
  for (size_t i = 0; i < f32.size(); ++i) {
    ASSERT_TRUE(std::isfinite(f32[i]) && std::isfinite(kept[i])) << i;
    max_abs = std::max(max_abs, std::abs(f32[i]));
    max_diff = std::max(max_diff, std::abs(kept[i] - f32[i]));
  }
  std::printf("q4_1 vs f32 logits: max |diff| %.5f, max |logit| %.4f\n", max_diff, max_abs);
  EXPECT_GT(max_abs, 0.1f);  // logits that say something
  // Q4_K, Q4_0, Q5_0, Q5_1, Q5_K and Q6_K (layer 0's down projection) keep their exact values;
  // Q3_K and Q2_K (a V, layer 1's down) are requantized to q8 (8 bits against 3); every one
  // multiplies activations quantized to 8 bits per 32 (kernels/cpu/int8_dot_gemm.cc): within a
  // percent or two of the range.
  EXPECT_LE(max_diff, 0.02f * max_abs) << "max |logit| " << max_abs;
}

}  // namespace
}  // namespace infinigen
