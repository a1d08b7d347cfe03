#include "gpu_worker/model/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace infinigen {
namespace {

using json = nlohmann::json;

absl::Status Bad(const MappedFile& f, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(f.path(), ": ", what));
}

}  // namespace

absl::Status ParseSafetensors(const MappedFile& file, std::vector<StoredTensor>& out,
                              std::map<std::string, std::string>* metadata) {
  if (file.size() < 8) return Bad(file, "truncated: shorter than the 8-byte header length");
  uint64_t header_len;
  std::memcpy(&header_len, file.data(), 8);
  if (header_len > file.size() - 8) {
    return Bad(file, absl::StrCat("truncated or not a safetensors file: header length ", header_len,
                                  " exceeds the file size ", file.size()));
  }
  const char* header = reinterpret_cast<const char*>(file.data() + 8);
  json j = json::parse(header, header + header_len, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Bad(file, "header is not a JSON object");

  const uint8_t* data = file.data() + 8 + header_len;
  const uint64_t data_size = file.size() - 8 - header_len;
  struct Range {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Range> ranges;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (metadata != nullptr && it.value().is_object()) {
        for (auto& [k, v] : it.value().items()) {
          if (v.is_string()) (*metadata)[k] = v.get<std::string>();
        }
      }
      continue;
    }
    const std::string& name = it.key();
    const json& t = it.value();
    auto bad_tensor = [&](const std::string& what) {
      return Bad(file, absl::StrCat("tensor ", name, ": ", what));
    };
    if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") ||
        !t.contains("data_offsets")) {
      return bad_tensor("entry needs dtype, shape and data_offsets");
    }
    StoredTensor st;
    st.name = st.file_name = name;
    st.file = file.path();
    const json& dtype = t["dtype"];
    if (!dtype.is_string()) return bad_tensor("dtype is not a string");
    const std::string dt = dtype.get<std::string>();
    if (dt == "F32")
      st.type = StorageType::kF32;
    else if (dt == "F16")
      st.type = StorageType::kF16;
    else if (dt == "BF16")
      st.type = StorageType::kBF16;
    else
      return bad_tensor(absl::StrCat("dtype ", dt, " is not supported (F32, F16, BF16)"));

    const json& shape = t["shape"];
    if (!shape.is_array()) return bad_tensor("shape is not an array");
    int64_t numel = 1;
    for (const json& d : shape) {
      if (!d.is_number_unsigned()) return bad_tensor("shape has a non-integer or negative dim");
      const uint64_t v = d.get<uint64_t>();
      if (v > 0 && static_cast<uint64_t>(numel) > std::numeric_limits<int64_t>::max() / 8 / v) {
        return bad_tensor("shape is too large");
      }
      numel *= static_cast<int64_t>(v);
      st.shape.push_back(static_cast<int64_t>(v));
    }
    const json& offsets = t["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned()) {
      return bad_tensor("data_offsets must be two non-negative integers");
    }
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    if (begin > end || end > data_size) {
      return bad_tensor(absl::StrCat("data_offsets [", begin, ", ", end,
                                     ") lie outside the data section of ", data_size,
                                     " bytes (file truncated?)"));
    }
    const uint64_t expected = static_cast<uint64_t>(numel) * StorageBlockBytes(st.type);
    if (end - begin != expected) {
      return bad_tensor(absl::StrCat("holds ", end - begin, " bytes but shape ", st.ShapeString(),
                                     " of ", dt, " needs ", expected));
    }
    st.data = data + begin;
    st.num_bytes = static_cast<int64_t>(end - begin);
    ranges.push_back({begin, end, name});
    out.push_back(std::move(st));
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].begin < ranges[i - 1].end) {
      return Bad(file, absl::StrCat("tensors ", ranges[i - 1].name, " and ", ranges[i].name,
                                    " overlap in the data section"));
    }
  }
  return absl::OkStatus();
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    const uint64_t bytes = t.values.size() * 4;
    header[t.name] = {
        {"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  const std::string tmp = path + ".tmp";
  std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
  if (!f) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open for writing"));
  const uint64_t len = text.size();
  f.write(reinterpret_cast<const char*>(&len), 8);
  f.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& t : tensors) {
    f.write(reinterpret_cast<const char*>(t.values.data()),
            static_cast<std::streamsize>(t.values.size() * 4));
  }
  f.close();
  if (!f) return absl::DataLossError(absl::StrCat(path, ": write failed (disk full?)"));
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::PermissionDeniedError(absl::StrCat(path, ": cannot rename ", tmp, " into place"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ParseSafetensorsIndex(absl::string_view text,
                                                               absl::string_view where) {
  const auto j =
      nlohmann::json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") ||
      !j["weight_map"].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": no \"weight_map\" object"));
  }
  std::set<std::string> names;
  for (const auto& [tensor, file] : j["weight_map"].items()) {
    if (!file.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": weight_map entry ", tensor, " is not a file name"));
    }
    const std::string& f = file.get_ref<const std::string&>();
    if (f.empty() || f == "." || f == ".." || f.find('/') != std::string::npos ||
        f.find('\0') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": shard name ", absl::CEscape(f),
                                                     " of ", tensor,
                                                     " must be a file in the folder"));
    }
    names.insert(f);
  }
  if (names.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the weight_map names no shard"));
  }
  return std::vector<std::string>(names.begin(), names.end());
}

}  // namespace infinigen
