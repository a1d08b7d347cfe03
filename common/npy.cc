#include "common/npy.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace infinigen {
namespace {

// Finds `'key': value` in a numpy header dict and returns the raw value text.
absl::StatusOr<std::string> HeaderValue(const std::string& header, const std::string& key) {
  std::string needle = absl::StrCat("'", key, "':");
  size_t pos = header.find(needle);
  if (pos == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("npy header has no '", key, "'"));
  }
  pos += needle.size();
  while (pos < header.size() && header[pos] == ' ') ++pos;
  size_t end = pos;
  if (pos < header.size() && header[pos] == '(') {
    end = header.find(')', pos);
    if (end == std::string::npos) return absl::InvalidArgumentError("npy header: unclosed shape");
    return header.substr(pos, end - pos + 1);
  }
  end = header.find_first_of(",}", pos);
  return header.substr(pos, end - pos);
}

}  // namespace

int64_t NpyArray::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<std::vector<float>> NpyArray::AsFloat() const {
  const int64_t n = NumElements();
  std::vector<float> out(n);
  if (descr == "<f4") {
    if (n > 0) std::memcpy(out.data(), data.data(), n * 4);  // (null data() of an empty array)
  } else if (descr == "<f8") {
    for (int64_t i = 0; i < n; ++i) {
      double d;
      std::memcpy(&d, data.data() + i * 8, 8);
      out[i] = static_cast<float>(d);
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat("npy dtype ", descr, " is not a float type"));
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> NpyArray::AsInt() const {
  const int64_t n = NumElements();
  std::vector<int64_t> out(n);
  if (descr == "<i4") {
    for (int64_t i = 0; i < n; ++i) {
      int32_t v;
      std::memcpy(&v, data.data() + i * 4, 4);
      out[i] = v;
    }
  } else if (descr == "<i8") {
    if (n > 0) std::memcpy(out.data(), data.data(), n * 8);  // (null data() of an empty array)
  } else {
    return absl::InvalidArgumentError(absl::StrCat("npy dtype ", descr, " is not an int type"));
  }
  return out;
}

absl::StatusOr<NpyArray> ReadNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a valid .npy file: ", what));
  };
  if (bytes.size() < 10 || std::memcmp(bytes.data(), "\x93NUMPY", 6) != 0) return bad("magic");
  const int major = bytes[6];
  size_t header_len, header_start;
  if (major == 1) {
    header_len = bytes[8] | (bytes[9] << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return bad("short header");
    header_len = bytes[8] | (bytes[9] << 8) | (bytes[10] << 16) | (size_t{bytes[11]} << 24);
    header_start = 12;
  } else {
    return bad(absl::StrCat("version ", major));
  }
  if (header_start + header_len > bytes.size()) return bad("header past end");
  std::string header(reinterpret_cast<const char*>(bytes.data() + header_start), header_len);

  NpyArray arr;
  auto descr = HeaderValue(header, "descr");
  auto order = HeaderValue(header, "fortran_order");
  auto shape = HeaderValue(header, "shape");
  if (!descr.ok() || !order.ok() || !shape.ok()) return bad("header fields");
  arr.descr = std::string(absl::StripSuffix(absl::StripPrefix(*descr, "'"), "'"));
  if (absl::StripAsciiWhitespace(*order) != "False") return bad("fortran order unsupported");
  std::string dims(absl::StripSuffix(absl::StripPrefix(*shape, "("), ")"));
  int64_t elements = 1;  // bounded as it grows: the product of huge dims must not overflow
  for (absl::string_view d : absl::StrSplit(dims, ',', absl::SkipWhitespace())) {
    int64_t v;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(d), &v) || v < 0) return bad("shape");
    if (v > 0 && elements > (int64_t{1} << 40) / v) return bad("shape too large");
    elements *= v;
    arr.shape.push_back(v);
  }
  size_t elem = 0;
  if (arr.descr == "<f4" || arr.descr == "<i4") elem = 4;
  if (arr.descr == "<f8" || arr.descr == "<i8") elem = 8;
  if (elem == 0) return bad(absl::StrCat("unsupported dtype ", arr.descr));
  const size_t data_start = header_start + header_len;
  const size_t need = static_cast<size_t>(arr.NumElements()) * elem;
  if (bytes.size() - data_start != need) return bad("data size does not match shape");
  arr.data.assign(bytes.begin() + data_start, bytes.end());
  return arr;
}

absl::Status WriteNpyF32(const std::string& path, const std::vector<int64_t>& shape,
                         const float* data) {
  std::string dims = absl::StrJoin(shape, ", ");
  if (shape.size() == 1) dims += ",";
  std::string header =
      absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': (", dims, "), }");
  // Pad with spaces so that the data starts at a multiple of 64 bytes, ending in '\n'.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "wb"), &std::fclose);
  if (!f) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open for writing"));
  const uint8_t preamble[10] = {0x93,
                                'N',
                                'U',
                                'M',
                                'P',
                                'Y',
                                1,
                                0,
                                static_cast<uint8_t>(header.size() & 0xff),
                                static_cast<uint8_t>(header.size() >> 8)};
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  if (std::fwrite(preamble, 1, 10, f.get()) != 10 ||
      std::fwrite(header.data(), 1, header.size(), f.get()) != header.size() ||
      std::fwrite(data, 4, n, f.get()) != static_cast<size_t>(n)) {
    return absl::DataLossError(absl::StrCat(path, ": write failed (disk full?)"));
  }
  return absl::OkStatus();
}

}  // namespace infinigen
