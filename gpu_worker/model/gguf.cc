#include "gpu_worker/model/gguf.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace infinigen {
namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" little-endian
constexpr int kMaxDims = 4;
constexpr uint64_t kDefaultAlignment = 32;

// Bounds-checked little-endian reader over the mapped file. Every read that would pass the
// end sets an error and returns zeros; callers check ok() at natural points.
class Reader {
 public:
  Reader(const MappedFile& f) : f_(f) {}
  bool ok() const { return ok_; }
  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return f_.size() - pos_; }
  const std::string& error() const { return error_; }

  bool Fail(const std::string& what) {
    if (ok_) error_ = absl::StrCat(what, " at byte ", pos_);
    ok_ = false;
    return false;
  }
  bool Read(void* dst, uint64_t n, const char* what) {
    if (!ok_) return false;
    if (n > remaining())
      return Fail(absl::StrCat("truncated: ", what, " runs past the end of the file"));
    std::memcpy(dst, f_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  template <typename T>
  T Get(const char* what) {
    T v{};
    Read(&v, sizeof(T), what);
    return v;
  }
  std::string String(const char* what) {
    const uint64_t n = Get<uint64_t>(what);
    if (!ok_) return {};
    if (n > remaining()) {
      Fail(absl::StrCat("truncated: ", what, " of ", n, " bytes runs past the end of the file"));
      return {};
    }
    std::string s(reinterpret_cast<const char*>(f_.data() + pos_), n);
    pos_ += n;
    return s;
  }

 private:
  const MappedFile& f_;
  uint64_t pos_ = 0;
  bool ok_ = true;
  std::string error_;
};

// Smallest encoded size of a value of `t`, to bound array lengths before allocating.
uint64_t MinEncodedSize(GgufType t) {
  switch (t) {
    case GgufType::kU8:
    case GgufType::kI8:
    case GgufType::kBool:
      return 1;
    case GgufType::kU16:
    case GgufType::kI16:
      return 2;
    case GgufType::kU32:
    case GgufType::kI32:
    case GgufType::kF32:
      return 4;
    case GgufType::kU64:
    case GgufType::kI64:
    case GgufType::kF64:
      return 8;
    case GgufType::kString:
      return 8;
    case GgufType::kArray:
      return 12;
  }
  return 1;
}

bool ReadValue(Reader& r, GgufType type, GgufValue& v, int depth) {
  v.type = type;
  switch (type) {
    case GgufType::kU8:
      v.u = r.Get<uint8_t>("u8 value");
      return r.ok();
    case GgufType::kI8:
      v.i = r.Get<int8_t>("i8 value");
      return r.ok();
    case GgufType::kU16:
      v.u = r.Get<uint16_t>("u16 value");
      return r.ok();
    case GgufType::kI16:
      v.i = r.Get<int16_t>("i16 value");
      return r.ok();
    case GgufType::kU32:
      v.u = r.Get<uint32_t>("u32 value");
      return r.ok();
    case GgufType::kI32:
      v.i = r.Get<int32_t>("i32 value");
      return r.ok();
    case GgufType::kU64:
      v.u = r.Get<uint64_t>("u64 value");
      return r.ok();
    case GgufType::kI64:
      v.i = r.Get<int64_t>("i64 value");
      return r.ok();
    case GgufType::kF32:
      v.f = r.Get<float>("f32 value");
      return r.ok();
    case GgufType::kF64:
      v.f = r.Get<double>("f64 value");
      return r.ok();
    case GgufType::kBool:
      v.u = r.Get<uint8_t>("bool value") != 0;
      return r.ok();
    case GgufType::kString:
      v.s = r.String("string value");
      return r.ok();
    case GgufType::kArray: {
      if (depth > 2) return r.Fail("arrays nested too deeply");
      const uint32_t elem = r.Get<uint32_t>("array type");
      const uint64_t n = r.Get<uint64_t>("array length");
      if (!r.ok()) return false;
      if (elem > static_cast<uint32_t>(GgufType::kF64)) {
        return r.Fail(absl::StrCat("unknown array element type ", elem));
      }
      v.array_type = static_cast<GgufType>(elem);
      if (n > r.remaining() / MinEncodedSize(v.array_type)) {
        return r.Fail(absl::StrCat("truncated: array of ", n, " elements runs past the end"));
      }
      GgufValue e;
      for (uint64_t k = 0; k < n; ++k) {
        if (!ReadValue(r, v.array_type, e, depth + 1)) return false;
        switch (v.array_type) {
          case GgufType::kString:
            v.strings.push_back(std::move(e.s));
            break;
          case GgufType::kF32:
          case GgufType::kF64:
            v.floats.push_back(e.f);
            break;
          case GgufType::kArray:
            v.arrays.push_back(std::move(e));
            e = GgufValue();
            break;
          default:
            v.ints.push_back(e.AsInt());
        }
      }
      return true;
    }
  }
  return r.Fail(absl::StrCat("unknown value type ", static_cast<uint32_t>(type)));
}

}  // namespace

bool GgufValue::IsInteger() const {
  switch (type) {
    case GgufType::kU8:
    case GgufType::kI8:
    case GgufType::kU16:
    case GgufType::kI16:
    case GgufType::kU32:
    case GgufType::kI32:
    case GgufType::kU64:
    case GgufType::kI64:
    case GgufType::kBool:
      return true;
    default:
      return false;
  }
}

int64_t GgufValue::AsInt() const {
  switch (type) {
    case GgufType::kI8:
    case GgufType::kI16:
    case GgufType::kI32:
    case GgufType::kI64:
      return i;
    default:
      return static_cast<int64_t>(u);
  }
}

absl::StatusOr<GgufFile> GgufFile::Parse(const MappedFile& file) {
  Reader r(file);
  auto fail = [&]() {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": ", r.error()));
  };
  const uint32_t magic = r.Get<uint32_t>("magic");
  if (!r.ok()) return fail();
  if (magic != kGgufMagic) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.path(), ": not a GGUF file (wrong magic number)"));
  }
  GgufFile g;
  g.version = r.Get<uint32_t>("version");
  if (r.ok() && (g.version < 2 || g.version > 3)) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.path(), ": GGUF version ", g.version, " is not supported (2 or 3)"));
  }
  const uint64_t tensor_count = r.Get<uint64_t>("tensor count");
  const uint64_t kv_count = r.Get<uint64_t>("metadata count");
  if (!r.ok()) return fail();
  // Each key/value needs >= 13 bytes and each tensor info >= 24: reject absurd counts early.
  if (kv_count > r.remaining() / 13 || tensor_count > r.remaining() / 24) {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": truncated: ", kv_count,
                                                   " metadata entries and ", tensor_count,
                                                   " tensors cannot fit in the file"));
  }
  for (uint64_t k = 0; k < kv_count; ++k) {
    std::string key = r.String("metadata key");
    const uint32_t type = r.Get<uint32_t>("metadata type");
    if (!r.ok()) return fail();
    if (type > static_cast<uint32_t>(GgufType::kF64)) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.path(), ": metadata ", key, " has unknown type ", type));
    }
    GgufValue v;
    if (!ReadValue(r, static_cast<GgufType>(type), v, 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.path(), ": metadata ", key, ": ", r.error()));
    }
    g.metadata[std::move(key)] = std::move(v);
  }

  struct Info {
    std::string name;
    std::vector<int64_t> shape;
    uint32_t type;
    uint64_t offset;
  };
  std::vector<Info> infos(tensor_count);
  for (auto& info : infos) {
    info.name = r.String("tensor name");
    const uint32_t n_dims = r.Get<uint32_t>("tensor rank");
    if (!r.ok()) return fail();
    if (n_dims == 0 || n_dims > kMaxDims) {
      return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensor ", info.name,
                                                     " has rank ", n_dims, " (1 to 4 allowed)"));
    }
    // GGUF lists dims innermost first; store them outermost first.
    std::vector<int64_t> dims(n_dims);
    for (auto& d : dims) {
      const uint64_t v = r.Get<uint64_t>("tensor dims");
      if (v == 0 || v > (uint64_t{1} << 40)) {
        if (!r.ok()) return fail();
        return absl::InvalidArgumentError(
            absl::StrCat(file.path(), ": tensor ", info.name, " has an invalid dimension ", v));
      }
      d = static_cast<int64_t>(v);
    }
    // The product of the dims too (each may be up to 2^40; their product overflowed int64 when
    // it was first computed: found by fuzzing). 2^50 elements is far past any real tensor.
    uint64_t elements = 1;
    for (int64_t d : dims) {
      if (elements > (uint64_t{1} << 50) / static_cast<uint64_t>(d)) {
        return absl::InvalidArgumentError(
            absl::StrCat(file.path(), ": tensor ", info.name, " has too many elements"));
      }
      elements *= static_cast<uint64_t>(d);
    }
    info.shape.assign(dims.rbegin(), dims.rend());
    info.type = r.Get<uint32_t>("tensor type");
    info.offset = r.Get<uint64_t>("tensor offset");
    if (!r.ok()) return fail();
  }

  uint64_t alignment = kDefaultAlignment;
  if (const GgufValue* a = g.Find("general.alignment"); a != nullptr && a->IsInteger()) {
    alignment = static_cast<uint64_t>(a->AsInt());
    if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.path(), ": general.alignment ", alignment, " is not a power of two"));
    }
  }
  const uint64_t data_start = (r.pos() + alignment - 1) / alignment * alignment;
  if (data_start > file.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.path(), ": truncated: no data section after the tensor infos"));
  }
  const uint64_t data_size = file.size() - data_start;

  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // [begin, end) -> index via name below
  std::vector<size_t> order;
  for (size_t k = 0; k < infos.size(); ++k) {
    const Info& info = infos[k];
    StoredTensor t;
    t.name = t.file_name = info.name;
    t.file = file.path();
    t.shape = info.shape;
    auto type = StorageTypeOfGgml(info.type);
    if (!type.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.path(), ": tensor ", info.name, ": ", type.status().message()));
    }
    t.type = *type;
    const int64_t numel = t.NumElements();
    if (info.shape.back() % StorageBlockElements(t.type) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          file.path(), ": tensor ", info.name, " of type ", StorageTypeName(t.type),
          " has rows of ", info.shape.back(), " elements, not a multiple of its block size"));
    }
    auto bytes = StorageBytes(t.type, numel);
    if (!bytes.ok()) return bytes.status();
    // GGUF places every tensor at a multiple of general.alignment; the decoders also need the
    // element alignment (4 bytes for F32, 2 for F16, BF16 and the blocks' f16 scales), which an
    // alignment of 1 or 2 would not give (found by fuzzing: a misaligned f16 load).
    const uint64_t element_align = t.type == StorageType::kF32 ? 4 : 2;
    if (info.offset % alignment != 0 || (data_start + info.offset) % element_align != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.path(), ": tensor ", info.name, " at data offset ", info.offset,
                       " is not aligned (general.alignment ", alignment, ", ", element_align,
                       " bytes for its elements)"));
    }
    if (info.offset > data_size || static_cast<uint64_t>(*bytes) > data_size - info.offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          file.path(), ": tensor ", info.name, " at data offset ", info.offset, " with ", *bytes,
          " bytes runs past the end of the file (", data_size, " data bytes; truncated?)"));
    }
    t.data = file.data() + data_start + info.offset;
    t.num_bytes = *bytes;
    ranges.emplace_back(info.offset, info.offset + *bytes);
    g.tensors.push_back(std::move(t));
  }
  order.resize(ranges.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return ranges[a].first < ranges[b].first; });
  for (size_t k = 1; k < order.size(); ++k) {
    if (ranges[order[k]].first < ranges[order[k - 1]].second) {
      return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensors ",
                                                     g.tensors[order[k - 1]].name, " and ",
                                                     g.tensors[order[k]].name, " overlap"));
    }
  }
  return g;
}

const GgufValue* GgufFile::Find(const std::string& key) const {
  auto it = metadata.find(key);
  return it == metadata.end() ? nullptr : &it->second;
}

int64_t GgufFile::IntOr(const std::string& key, int64_t fallback) const {
  const GgufValue* v = Find(key);
  return v != nullptr && v->IsInteger() ? v->AsInt() : fallback;
}

double GgufFile::FloatOr(const std::string& key, double fallback) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return fallback;
  if (v->type == GgufType::kF32 || v->type == GgufType::kF64) return v->f;
  return v->IsInteger() ? static_cast<double>(v->AsInt()) : fallback;
}

std::string GgufFile::StringOr(const std::string& key, const std::string& fallback) const {
  const GgufValue* v = Find(key);
  return v != nullptr && v->type == GgufType::kString ? v->s : fallback;
}

namespace {

const std::map<std::string, std::string>& GlobalNames() {
  static const auto* names = new std::map<std::string, std::string>{
      {"token_embd.weight", "model.embed_tokens.weight"},
      {"output_norm.weight", "model.norm.weight"},
      {"output.weight", "lm_head.weight"},
      {"rope_freqs.weight", "rope_freqs.weight"},
  };
  return *names;
}

// GGUF block tensor stem -> Hugging Face module path within model.layers.N.
const std::map<std::string, std::string>& LayerNames() {
  static const auto* names = new std::map<std::string, std::string>{
      {"attn_norm", "input_layernorm"},    {"attn_q", "self_attn.q_proj"},
      {"attn_k", "self_attn.k_proj"},      {"attn_v", "self_attn.v_proj"},
      {"attn_output", "self_attn.o_proj"}, {"ffn_norm", "post_attention_layernorm"},
      {"ffn_gate", "mlp.gate_proj"},       {"ffn_up", "mlp.up_proj"},
      {"ffn_down", "mlp.down_proj"},
  };
  return *names;
}

}  // namespace

std::string GgufToHfName(const std::string& gguf_name) {
  if (auto it = GlobalNames().find(gguf_name); it != GlobalNames().end()) return it->second;
  std::vector<std::string> parts = absl::StrSplit(gguf_name, '.');
  int layer;
  if (parts.size() != 4 || parts[0] != "blk" || !absl::SimpleAtoi(parts[1], &layer)) return "";
  auto it = LayerNames().find(parts[2]);
  if (it == LayerNames().end()) return "";
  return absl::StrCat("model.layers.", layer, ".", it->second, ".", parts[3]);
}

std::string HfToGgufName(const std::string& hf_name) {
  for (const auto& [gguf, hf] : GlobalNames()) {
    if (hf == hf_name) return gguf;
  }
  int layer;
  std::vector<std::string> parts = absl::StrSplit(hf_name, '.');
  if (parts.size() < 5 || parts[0] != "model" || parts[1] != "layers" ||
      !absl::SimpleAtoi(parts[2], &layer)) {
    return "";
  }
  const std::string suffix = parts.back();
  std::string module;
  for (size_t i = 3; i + 1 < parts.size(); ++i) module += (module.empty() ? "" : ".") + parts[i];
  for (const auto& [stem, hf] : LayerNames()) {
    if (hf == module) return absl::StrCat("blk.", layer, ".", stem, ".", suffix);
  }
  return "";
}

absl::StatusOr<ModelConfig> GgufModelConfig(const GgufFile& g, const std::string& path) {
  const std::string arch = g.StringOr("general.architecture", "");
  if (arch != "llama") {
    return absl::InvalidArgumentError(absl::StrCat(path, ": GGUF architecture \"", arch,
                                                   "\" is not supported (supported: llama)"));
  }
  auto required = [&](const std::string& key) -> absl::StatusOr<int64_t> {
    const GgufValue* v = g.Find(key);
    if (v == nullptr || !v->IsInteger()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": missing or non-integer metadata ", key));
    }
    return v->AsInt();
  };
  ModelConfig c;
  c.architecture = Architecture::kLlama;
  c.name = g.StringOr("general.name", "gguf");
  auto layers = required("llama.block_count");
  auto hidden = required("llama.embedding_length");
  auto ffn = required("llama.feed_forward_length");
  auto heads = required("llama.attention.head_count");
  for (auto* s : {&layers, &hidden, &ffn, &heads}) {
    if (!s->ok()) return s->status();
  }
  c.num_layers = *layers;
  c.hidden_size = *hidden;
  c.intermediate_size = *ffn;
  c.num_heads = *heads;
  c.num_kv_heads = g.IntOr("llama.attention.head_count_kv", c.num_heads);
  c.head_dim =
      g.IntOr("llama.attention.key_length", c.num_heads > 0 ? c.hidden_size / c.num_heads : 0);
  c.max_position_embeddings = g.IntOr("llama.context_length", 2048);
  c.norm_eps = static_cast<float>(g.FloatOr("llama.attention.layer_norm_rms_epsilon", 1e-5));
  c.activation = Activation::kSilu;
  c.rope.theta = g.FloatOr("llama.rope.freq_base", 10000.0);
  c.rope.rotary_dim = static_cast<int>(g.IntOr("llama.rope.dimension_count", c.head_dim));
  // llama.cpp's converter permutes Q/K rows so that RoPE pairs adjacent channels.
  c.rope.layout = cpu::RopeLayout::kInterleaved;
  const std::string scaling = g.StringOr("llama.rope.scaling.type", "none");
  if (scaling == "linear") {
    c.rope.scaling = RopeScaling::kLinear;
    c.rope.factor = g.FloatOr("llama.rope.scaling.factor", 1.0);
  } else if (scaling != "none") {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": rope scaling \"", scaling,
                     "\" is not supported (none, linear; llama3 scaling "
                     "comes as the rope_freqs tensor)"));
  }
  bool has_output = false;
  int64_t vocab = -1;
  for (const StoredTensor& t : g.tensors) {
    if (t.name == "output.weight") has_output = true;
    if (t.name == "token_embd.weight" && t.shape.size() == 2) vocab = t.shape[0];
  }
  c.tie_word_embeddings = !has_output;
  if (const GgufValue* t = g.Find("tokenizer.ggml.tokens"); vocab < 0 && t != nullptr) {
    vocab = static_cast<int64_t>(t->ArraySize());
  }
  c.vocab_size = g.IntOr("llama.vocab_size", vocab);
  c.bos_token_id = static_cast<int32_t>(g.IntOr("tokenizer.ggml.bos_token_id", -1));
  const int64_t eos = g.IntOr("tokenizer.ggml.eos_token_id", -1);
  if (eos >= 0) c.eos_token_ids.push_back(static_cast<int32_t>(eos));
  const int64_t eot = g.IntOr("tokenizer.ggml.eot_token_id", -1);
  if (eot >= 0 && eot != eos) c.eos_token_ids.push_back(static_cast<int32_t>(eot));
  // As llama.cpp does, every control token spelled like an end of turn also ends generation
  // (SmolLM2's GGUF names <|im_start|> as EOS while chat turns end with <|im_end|>).
  static const std::set<std::string> kEndOfGeneration = {
      "<|im_end|>",      "<|endoftext|>", "<|eot_id|>", "<|eom_id|>",
      "<|end_of_text|>", "</s>",          "<|end|>",    "<end_of_turn>"};
  const GgufValue* tokens = g.Find("tokenizer.ggml.tokens");
  const GgufValue* types = g.Find("tokenizer.ggml.token_type");
  if (tokens != nullptr && types != nullptr && types->ints.size() == tokens->strings.size()) {
    constexpr int64_t kControlToken = 3;
    for (size_t id = 0; id < tokens->strings.size(); ++id) {
      if (types->ints[id] == kControlToken && kEndOfGeneration.count(tokens->strings[id]) > 0 &&
          std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), id) == c.eos_token_ids.end()) {
        c.eos_token_ids.push_back(static_cast<int32_t>(id));
      }
    }
  }
  if (auto st = c.Validate(path); !st.ok()) return st;
  return c;
}

}  // namespace infinigen
