// The UTF-8 check that names a request's bad string field (common/grpc/utf8_fields.h): the
// validator against Python's codec rules, and field paths through nested and repeated fields of
// real request bytes (serialized valid, then patched in place: protobuf itself will not write
// invalid UTF-8 into a string field).
#include "common/grpc/utf8_fields.h"

#include <gtest/gtest.h>

#include "infinigen/v1/generation.pb.h"

namespace infinigen {
namespace {

TEST(Utf8Fields, ValidatorAcceptsUtf8AndRefusesTheRest) {
  for (const char* ok : {"", "plain", "caf\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x98\x80",
                         "\xef\xbf\xbf", "\xf4\x8f\xbf\xbf"}) {
    EXPECT_TRUE(IsValidUtf8(ok)) << ok;
  }
  for (const char* bad : {"\xff", "\x80", "\xc3", "\xc3\x28", "\xc0\xaf",  // overlong '/'
                          "\xe0\x80\xaf", "\xed\xa0\x80",                  // surrogate U+D800
                          "\xf4\x90\x80\x80",                              // past U+10FFFF
                          "\xf8\x88\x80\x80\x80", "ok\xe2\x82"}) {
    EXPECT_FALSE(IsValidUtf8(bad)) << testing::PrintToString(std::string(bad));
  }
}

// `request` serialized, with the first occurrence of `marker` overwritten by 0xFF bytes.
std::string Patched(const v1::GenerateRequest& request, const std::string& marker) {
  std::string bytes = request.SerializeAsString();
  const size_t at = bytes.find(marker);
  EXPECT_NE(at, std::string::npos);
  if (at != std::string::npos) bytes.replace(at, marker.size(), std::string(marker.size(), '\xff'));
  return bytes;
}

TEST(Utf8Fields, NamesTheFirstBadFieldWithItsPath) {
  v1::GenerateRequest r;
  for (const char* content : {"first", "second", "MARK"}) {
    auto* m = r.mutable_messages()->add_messages();
    m->set_role("user");
    m->set_content(content);
  }
  r.mutable_stopping()->add_stop_strings("a");
  r.mutable_stopping()->add_stop_strings("STOP");
  r.set_session_id("SESSION");
  const auto& type = *v1::GenerateRequest::descriptor();
  EXPECT_EQ(FirstInvalidUtf8Field(type, r.SerializeAsString()), "");
  EXPECT_EQ(FirstInvalidUtf8Field(type, Patched(r, "MARK")), "messages.messages[2].content");
  EXPECT_EQ(FirstInvalidUtf8Field(type, Patched(r, "STOP")), "stopping.stop_strings[1]");
  EXPECT_EQ(FirstInvalidUtf8Field(type, Patched(r, "SESSION")), "session_id");
  // Not a message at all: left to the normal parse.
  EXPECT_EQ(FirstInvalidUtf8Field(type, "\xff\xff\xff"), "");
}

}  // namespace
}  // namespace infinigen
