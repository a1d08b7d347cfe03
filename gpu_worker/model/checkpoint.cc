#include "gpu_worker/model/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "gpu_worker/model/safetensors.h"

namespace infinigen {
namespace {

namespace fs = std::filesystem;

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& path) {
  std::unique_ptr<Checkpoint> ckpt(new Checkpoint());
  ckpt->path_ = path;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    IG_RETURN_IF_ERROR(ckpt->OpenHfFolder(path));
  } else if (fs::is_regular_file(path, ec)) {
    IG_RETURN_IF_ERROR(ckpt->OpenGguf(path));
  } else {
    return absl::NotFoundError(
        absl::StrCat(path, ": no such model (expected a folder with config.json or a .gguf file)"));
  }
  return ckpt;
}

absl::Status Checkpoint::OpenHfFolder(const std::string& dir) {
  const std::string config_path = (fs::path(dir) / "config.json").string();
  IG_ASSIGN_OR_RETURN(std::string config_text, ReadText(config_path));
  IG_ASSIGN_OR_RETURN(config_, ParseHfConfig(config_text, config_path));

  std::vector<std::string> shards;
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::error_code ec;
  if (fs::exists(index, ec)) {
    IG_ASSIGN_OR_RETURN(std::string text, ReadText(index.string()));
    IG_ASSIGN_OR_RETURN(std::vector<std::string> names,
                        ParseSafetensorsIndex(text, index.string()));
    for (const auto& n : names) shards.push_back((fs::path(dir) / n).string());
  } else if (fs::exists(single, ec)) {
    shards.push_back(single.string());
  } else {
    return absl::NotFoundError(
        absl::StrCat(dir,
                     ": no model.safetensors or model.safetensors.index.json (only safetensors "
                     "checkpoints are supported)"));
  }
  for (const auto& shard : shards) {
    IG_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(shard));
    files_.push_back(std::make_unique<MappedFile>(std::move(file)));
    std::vector<StoredTensor> tensors;
    IG_RETURN_IF_ERROR(ParseSafetensors(*files_.back(), tensors));
    // Some OPT checkpoints omit the "model." prefix; the loader asks for prefixed names.
    if (config_.architecture == Architecture::kOpt) {
      for (auto& t : tensors) {
        if (absl::StartsWith(t.name, "decoder.")) t.name = "model." + t.name;
      }
    }
    IG_RETURN_IF_ERROR(AddTensors(std::move(tensors)));
  }
  return absl::OkStatus();
}

absl::Status Checkpoint::OpenGguf(const std::string& path) {
  IG_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path));
  files_.push_back(std::make_unique<MappedFile>(std::move(file)));
  IG_ASSIGN_OR_RETURN(GgufFile g, GgufFile::Parse(*files_.back()));
  IG_ASSIGN_OR_RETURN(config_, GgufModelConfig(g, path));
  std::vector<StoredTensor> tensors;
  for (const StoredTensor& t : g.tensors) {
    std::string hf = GgufToHfName(t.name);
    if (hf.empty()) continue;  // not part of the model graph we run
    StoredTensor renamed = t;
    renamed.name = std::move(hf);
    tensors.push_back(std::move(renamed));
  }
  gguf_ = std::move(g);
  return AddTensors(std::move(tensors));
}

absl::Status Checkpoint::AddTensors(std::vector<StoredTensor> tensors) {
  for (auto& t : tensors) {
    std::string name = t.name;
    auto [it, inserted] = tensors_.emplace(name, std::move(t));
    if (!inserted) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", name, " appears twice (in ", it->second.file, " and again)"));
    }
  }
  return absl::OkStatus();
}

const StoredTensor* Checkpoint::Find(absl::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::StatusOr<const StoredTensor*> Checkpoint::Get(absl::string_view name,
                                                    const std::vector<int64_t>& shape) const {
  const StoredTensor* t = Find(name);
  if (t == nullptr) {
    std::string gguf_name = gguf_ ? HfToGgufName(std::string(name)) : "";
    return absl::NotFoundError(
        absl::StrCat(path_, ": tensor ", name,
                     gguf_name.empty() ? "" : absl::StrCat(" (", gguf_name, ")"), " is missing"));
  }
  if (t->shape != shape) {
    return absl::InvalidArgumentError(
        absl::StrCat(t->file, ": tensor ", t->file_name, " has shape ", t->ShapeString(),
                     ", config expects [", absl::StrJoin(shape, ", "), "]"));
  }
  return t;
}

absl::StatusOr<std::vector<float>> Checkpoint::ReadFloat(absl::string_view name,
                                                         const std::vector<int64_t>& shape) const {
  IG_ASSIGN_OR_RETURN(const StoredTensor* t, Get(name, shape));
  std::vector<float> values(t->NumElements());
  DecodeToFloat(*t, values.data());
  return values;
}

void Checkpoint::DropPages(const StoredTensor& t) const {
  for (const auto& f : files_) {
    if (t.data >= f->data() && t.data < f->data() + f->size()) {
      f->DropPages(static_cast<size_t>(t.data - f->data()), static_cast<size_t>(t.num_bytes));
    }
  }
}

std::vector<std::string> Checkpoint::TensorNames() const {
  std::vector<std::string> names;
  for (const auto& [name, t] : tensors_) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace infinigen
