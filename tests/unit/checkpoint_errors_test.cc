// Bad checkpoint files: each is rejected with an error naming the file, the tensor and what is
// wrong, never a crash or an out-of-bounds read (run under ASan with INFINIGEN_SANITIZE=ON).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/model.h"
#include "gpu_worker/model/safetensors.h"
#include "tests/support/gguf_writer.h"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

namespace fs = std::filesystem;
using testing::GgufWriter;
using testing::WriteFile;

class CheckpointErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("infinigen_ckpt_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  // A folder with `config` and a model.safetensors of `header` (JSON) followed by `data`.
  std::string HfFolder(const std::string& config, const std::string& header,
                       const std::vector<uint8_t>& data, int64_t header_len_override = -1) {
    std::ofstream(Path("config.json")) << config;
    const uint64_t len = header_len_override >= 0 ? header_len_override : header.size();
    std::string bytes(8, '\0');
    std::memcpy(bytes.data(), &len, 8);
    bytes += header;
    bytes.append(data.begin(), data.end());
    WriteFile(Path("model.safetensors"), std::vector<uint8_t>(bytes.begin(), bytes.end()));
    return dir_.string();
  }

  fs::path dir_;
};

const char* kTinyLlamaConfig = R"({"model_type": "llama", "vocab_size": 4, "hidden_size": 2,
  "intermediate_size": 2, "num_hidden_layers": 1, "num_attention_heads": 1,
  "max_position_embeddings": 16})";

void ExpectError(const absl::Status& st, absl::StatusCode code,
                 std::initializer_list<std::string> words) {
  EXPECT_EQ(st.code(), code) << st;
  for (const auto& w : words)
    EXPECT_NE(st.message().find(w), std::string::npos) << w << " not in: " << st;
}

absl::Status LoadModel(const std::string& path) {
  auto ckpt = Checkpoint::Open(path);
  if (!ckpt.ok()) return ckpt.status();
  CpuBackend backend;
  return Model::Load(**ckpt, backend).status();
}

TEST_F(CheckpointErrors, SafetensorsHeaderLongerThanFile) {
  auto dir = HfFolder(kTinyLlamaConfig, "{}", {}, 1000);
  ExpectError(Checkpoint::Open(dir).status(), absl::StatusCode::kInvalidArgument,
              {"model.safetensors", "header length 1000"});
}

TEST_F(CheckpointErrors, SafetensorsHeaderIsNotJson) {
  auto dir = HfFolder(kTinyLlamaConfig, "GGUF\x03garbage", {});
  ExpectError(Checkpoint::Open(dir).status(), absl::StatusCode::kInvalidArgument,
              {"model.safetensors", "not a JSON object"});
}

TEST_F(CheckpointErrors, SafetensorsTruncatedData) {
  auto dir =
      HfFolder(kTinyLlamaConfig,
               R"({"model.norm.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
               std::vector<uint8_t>(5));
  ExpectError(Checkpoint::Open(dir).status(), absl::StatusCode::kInvalidArgument,
              {"model.safetensors", "model.norm.weight", "truncated"});
}

TEST_F(CheckpointErrors, SafetensorsOverlappingTensors) {
  auto dir = HfFolder(kTinyLlamaConfig,
                      R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                      std::vector<uint8_t>(12));
  ExpectError(Checkpoint::Open(dir).status(), absl::StatusCode::kInvalidArgument,
              {"model.safetensors", "overlap", "a", "b"});
}

TEST_F(CheckpointErrors, SafetensorsUnknownDtype) {
  auto dir =
      HfFolder(kTinyLlamaConfig,
               R"({"model.norm.weight": {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]}})",
               std::vector<uint8_t>(16));
  ExpectError(Checkpoint::Open(dir).status(), absl::StatusCode::kInvalidArgument,
              {"model.norm.weight", "F64", "not supported"});
}

TEST_F(CheckpointErrors, SafetensorsSizeDisagreesWithShape) {
  auto dir =
      HfFolder(kTinyLlamaConfig,
               R"({"model.norm.weight": {"dtype": "F16", "shape": [3], "data_offsets": [0, 8]}})",
               std::vector<uint8_t>(8));
  ExpectError(Checkpoint::Open(dir).status(), absl::StatusCode::kInvalidArgument,
              {"model.norm.weight", "holds 8 bytes", "needs 6"});
}

TEST_F(CheckpointErrors, MissingTensorIsNamed) {
  // Only the embedding exists; the final norm is the next tensor the loader asks for.
  auto dir = HfFolder(
      kTinyLlamaConfig,
      R"({"model.embed_tokens.weight": {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, 32]}})",
      std::vector<uint8_t>(32));
  ExpectError(LoadModel(dir), absl::StatusCode::kNotFound, {"model.norm.weight", "missing"});
}

TEST_F(CheckpointErrors, ShapeThatContradictsConfigIsNamed) {
  auto dir = HfFolder(
      kTinyLlamaConfig,
      R"({"model.embed_tokens.weight": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 48]}})",
      std::vector<uint8_t>(48));
  ExpectError(LoadModel(dir), absl::StatusCode::kInvalidArgument,
              {"model.embed_tokens.weight", "[4, 3]", "config expects [4, 2]"});
}

TEST_F(CheckpointErrors, UnknownArchitectureAndMissingConfig) {
  auto dir = HfFolder(R"({"model_type": "mamba", "vocab_size": 4})", "{}", {});
  ExpectError(Checkpoint::Open(dir).status(), absl::StatusCode::kInvalidArgument,
              {"config.json", "mamba", "not supported"});
  fs::remove(Path("config.json"));
  ExpectError(Checkpoint::Open(dir).status(), absl::StatusCode::kNotFound, {"config.json"});
  ExpectError(Checkpoint::Open(Path("nope")).status(), absl::StatusCode::kNotFound, {"nope"});
}

TEST_F(CheckpointErrors, ShardIndexMustNameFilesInTheFolder) {
  std::ofstream(Path("config.json")) << kTinyLlamaConfig;
  std::ofstream(Path("model.safetensors.index.json"))
      << R"({"weight_map": {"model.norm.weight": "../../etc/passwd"}})";
  ExpectError(Checkpoint::Open(dir_.string()).status(), absl::StatusCode::kInvalidArgument,
              {"shard name", "../../etc/passwd"});
}

// The index's own parse: every malformed shard list is an error naming the index and the
// entry; a valid one lists each shard once, sorted.
TEST(SafetensorsIndex, NamesEachShardOnceOrSaysWhatIsWrong) {
  auto ok = ParseSafetensorsIndex(
      R"({"metadata": {}, "weight_map": {"a": "m-2.safetensors", "b": "m-1.safetensors",
          "c": "m-2.safetensors"}})",
      "idx.json");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, (std::vector<std::string>{"m-1.safetensors", "m-2.safetensors"}));
  for (const auto& [text, want] : std::vector<std::pair<std::string, std::string>>{
           {"not json", "no \"weight_map\" object"},
           {"[1, 2]", "no \"weight_map\" object"},
           {R"({"weight_map": []})", "no \"weight_map\" object"},
           {R"({"weight_map": {}})", "names no shard"},
           {R"({"weight_map": {"w": 3}})", "entry w is not a file name"},
           {R"({"weight_map": {"w": ""}})", "shard name  of w"},
           {R"({"weight_map": {"w": "."}})", "shard name . of w"},
           {R"({"weight_map": {"w": "sub/m.safetensors"}})", "shard name sub/m.safetensors"},
           {R"({"weight_map": {"w": "m\u0000/x"}})", "shard name m\\000/x"}}) {
    auto got = ParseSafetensorsIndex(text, "idx.json");
    ASSERT_FALSE(got.ok()) << text;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << text;
    const std::string message(got.status().message());
    EXPECT_NE(message.find("idx.json"), std::string::npos) << message;
    EXPECT_NE(message.find(want), std::string::npos) << message << " lacks: " << want;
  }
}

// A minimal valid llama GGUF: one layer, hidden 32 (one Q8_0 block per row), vocab 3.
GgufWriter TinyGguf() {
  GgufWriter w;
  w.AddString("general.architecture", "llama");
  w.AddU32("llama.block_count", 1);
  w.AddU32("llama.embedding_length", 32);
  w.AddU32("llama.feed_forward_length", 32);
  w.AddU32("llama.attention.head_count", 4);
  w.AddU32("llama.context_length", 64);
  w.AddF32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  w.AddStringArray("tokenizer.ggml.tokens", {"a", "b", "c"});
  w.AddF32Tensor("token_embd.weight", {3, 32}, std::vector<float>(96, 0.5f));
  w.AddF32Tensor("output_norm.weight", {32}, std::vector<float>(32, 1.0f));
  return w;
}

TEST_F(CheckpointErrors, GgufWrongMagic) {
  auto bytes = TinyGguf().Build();
  bytes[0] = 'X';
  WriteFile(Path("m.gguf"), bytes);
  ExpectError(Checkpoint::Open(Path("m.gguf")).status(), absl::StatusCode::kInvalidArgument,
              {"m.gguf", "wrong magic"});
}

TEST_F(CheckpointErrors, GgufEveryTruncationIsAnErrorNotACrash) {
  const auto bytes = TinyGguf().Build();
  ASSERT_TRUE(Checkpoint::Open((WriteFile(Path("full.gguf"), bytes), Path("full.gguf"))).ok());
  for (size_t len = 0; len < bytes.size(); len += 7) {
    WriteFile(Path("cut.gguf"), {bytes.begin(), bytes.begin() + len});
    auto st = Checkpoint::Open(Path("cut.gguf")).status();
    ASSERT_FALSE(st.ok()) << "accepted a file cut at " << len << " of " << bytes.size();
    ASSERT_NE(st.message().find("cut.gguf"), std::string::npos) << st;
  }
}

TEST_F(CheckpointErrors, GgufOffsetPastTheEnd) {
  WriteFile(Path("m.gguf"), TinyGguf().Build(/*offset_shift=*/1 << 20));
  ExpectError(Checkpoint::Open(Path("m.gguf")).status(), absl::StatusCode::kInvalidArgument,
              {"m.gguf", "token_embd.weight", "past the end"});
}

TEST_F(CheckpointErrors, GgufMisalignedTensor) {
  WriteFile(Path("m.gguf"), TinyGguf().Build(/*offset_shift=*/1));
  ExpectError(Checkpoint::Open(Path("m.gguf")).status(), absl::StatusCode::kInvalidArgument,
              {"m.gguf", "token_embd.weight", "not aligned"});
}

TEST_F(CheckpointErrors, GgufOverlappingTensors) {
  GgufWriter w = TinyGguf();
  w.AddTensor("blk.0.attn_norm.weight", {32}, 0, std::vector<uint8_t>(128), /*offset=*/0);
  WriteFile(Path("m.gguf"), w.Build());
  ExpectError(Checkpoint::Open(Path("m.gguf")).status(), absl::StatusCode::kInvalidArgument,
              {"m.gguf", "overlap", "token_embd.weight", "blk.0.attn_norm.weight"});
}

TEST_F(CheckpointErrors, GgufUnsupportedTensorType) {
  GgufWriter w = TinyGguf();
  w.AddTensor("blk.0.ffn_up.weight", {32, 256}, /*IQ2_XXS=*/16, std::vector<uint8_t>(66 * 32));
  WriteFile(Path("m.gguf"), w.Build());
  ExpectError(Checkpoint::Open(Path("m.gguf")).status(), absl::StatusCode::kInvalidArgument,
              {"blk.0.ffn_up.weight", "type id 16", "not supported", "Q4_K"});
}

TEST_F(CheckpointErrors, GgufKQuantRowsNotAMultipleOf256) {
  GgufWriter w = TinyGguf();
  // K-quants come in super-blocks of 256 weights of a row; 288 columns cannot hold them.
  w.AddTensor("blk.0.ffn_up.weight", {32, 288}, /*Q4_K=*/12, std::vector<uint8_t>(144 * 36));
  WriteFile(Path("m.gguf"), w.Build());
  ExpectError(Checkpoint::Open(Path("m.gguf")).status(), absl::StatusCode::kInvalidArgument,
              {"blk.0.ffn_up.weight", "Q4_K", "not a multiple of its block size"});
}

TEST_F(CheckpointErrors, GgufUnknownArchitecture) {
  GgufWriter w;
  w.AddString("general.architecture", "rwkv");
  WriteFile(Path("m.gguf"), w.Build());
  ExpectError(Checkpoint::Open(Path("m.gguf")).status(), absl::StatusCode::kInvalidArgument,
              {"m.gguf", "rwkv", "not supported"});
}

TEST_F(CheckpointErrors, GgufMissingTensorAndWrongShapeAreNamed) {
  WriteFile(Path("m.gguf"), TinyGguf().Build());
  ExpectError(LoadModel(Path("m.gguf")), absl::StatusCode::kNotFound,
              {"model.layers.0.input_layernorm.weight", "missing"});
  GgufWriter w = TinyGguf();
  w.AddF32Tensor("blk.0.attn_norm.weight", {31}, std::vector<float>(31, 1.0f));
  WriteFile(Path("m2.gguf"), w.Build());
  ExpectError(LoadModel(Path("m2.gguf")), absl::StatusCode::kInvalidArgument,
              {"blk.0.attn_norm.weight", "[31]", "config expects [32]"});
}

TEST_F(CheckpointErrors, GgufAbsurdCountsAreRejectedBeforeAllocating) {
  auto bytes = TinyGguf().Build();
  const uint64_t huge = 1ull << 60;
  std::memcpy(bytes.data() + 8, &huge, 8);  // tensor count
  WriteFile(Path("m.gguf"), bytes);
  ExpectError(Checkpoint::Open(Path("m.gguf")).status(), absl::StatusCode::kInvalidArgument,
              {"m.gguf", "cannot fit"});
}

}  // namespace
}  // namespace infinigen
