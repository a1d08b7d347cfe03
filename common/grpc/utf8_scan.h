// The UTF-8 check of a serialized request's string fields, read from the wire by the message's
// descriptor (protobuf only; the gRPC handler that uses it is utf8_fields.h). Fuzzed:
// tests/fuzz/generate_request_fuzz.cc.
#pragma once

#include <google/protobuf/descriptor.h>

#include <string>
#include <string_view>

namespace infinigen {

// Whether `s` is well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF:
// what protobuf accepts in a string field).
bool IsValidUtf8(std::string_view s);

// The path of the first string field of `bytes` (a serialized `type`, read by its descriptor,
// nested messages included) that holds invalid UTF-8, with indices for repeated fields; empty
// when every string is valid, or when the bytes are not a well-formed message (the normal parse
// then reports that). Messages nested deeper than protobuf's own parser allows (100) are not
// read: a recursive message type (none of ours yet) could otherwise recurse until the stack
// runs out.
std::string FirstInvalidUtf8Field(const google::protobuf::Descriptor& type, std::string_view bytes);

}  // namespace infinigen
