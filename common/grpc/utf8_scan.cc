#include "common/grpc/utf8_scan.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>

#include <map>

namespace infinigen {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::internal::WireFormatLite;

bool IsValidUtf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  while (p < end) {
    const unsigned c = *p;
    if (c < 0x80) {
      ++p;
      continue;
    }
    int n;
    unsigned min, cp;
    if ((c & 0xE0) == 0xC0) {
      n = 1, min = 0x80, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2, min = 0x800, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3, min = 0x10000, cp = c & 0x07;
    } else {
      return false;  // a continuation byte first, or 0xF8..0xFF
    }
    if (end - p <= n) return false;
    for (int i = 1; i <= n; ++i) {
      if ((p[i] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    p += n + 1;
  }
  return true;
}

namespace {

constexpr int kMaxDepth = 100;  // protobuf's default recursion limit

std::string FirstInvalidUtf8Field(const Descriptor& type, std::string_view bytes, int depth) {
  if (depth > kMaxDepth) return "";  // the parse refuses it anyway
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                                            static_cast<int>(bytes.size()));
  std::map<int, int> seen;  // occurrences per field number, for the index of repeated fields
  for (uint32_t tag = in.ReadTag(); tag != 0; tag = in.ReadTag()) {
    const FieldDescriptor* f = type.FindFieldByNumber(WireFormatLite::GetTagFieldNumber(tag));
    if (WireFormatLite::GetTagWireType(tag) != WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      if (!WireFormatLite::SkipField(&in, tag)) return "";
      continue;
    }
    uint32_t length = 0;
    std::string payload;
    if (!in.ReadVarint32(&length) || !in.ReadString(&payload, static_cast<int>(length))) return "";
    if (f == nullptr) continue;
    const int index = seen[f->number()]++;
    const std::string name =
        f->is_repeated() ? f->name() + "[" + std::to_string(index) + "]" : f->name();
    if (f->type() == FieldDescriptor::TYPE_STRING && !IsValidUtf8(payload)) return name;
    if (f->type() == FieldDescriptor::TYPE_MESSAGE) {
      const std::string inner = FirstInvalidUtf8Field(*f->message_type(), payload, depth + 1);
      if (!inner.empty()) return name + "." + inner;
    }
  }
  return "";
}

}  // namespace

std::string FirstInvalidUtf8Field(const Descriptor& type, std::string_view bytes) {
  return FirstInvalidUtf8Field(type, bytes, 0);
}

}  // namespace infinigen
