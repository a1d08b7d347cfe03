// The ghz configs under examples/ghz/ name a real method and their request data parses as that
// method's request message (ghz would reject them otherwise, and ghz cannot run here).
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include "infinigen/v1/generation.pb.h"
#include "nlohmann/json.hpp"

namespace infinigen {
namespace {

TEST(GhzConfigs, DataParsesAsTheCalledMethodsRequest) {
  const std::filesystem::path dir =
      std::filesystem::path(std::string(INFINIGEN_SOURCE_DIR) + "/examples/ghz");
  int checked = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".json") continue;
    std::ifstream in(entry.path());
    const auto config = nlohmann::json::parse(in, nullptr, false);
    ASSERT_FALSE(config.is_discarded()) << entry.path();
    const std::string call = config.at("call");
    // ghz's template variables become numbers for the check.
    const std::string data =
        std::regex_replace(config.at("data").dump(), std::regex(R"(\{\{\.\w+\}\})"), "1");
    google::protobuf::util::JsonParseOptions strict;
    strict.ignore_unknown_fields = false;
    if (call == "infinigen.v1.Generation.Generate") {
      v1::GenerateRequest r;
      ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(data, &r, strict).ok())
          << entry.path() << ": " << data;
      EXPECT_NE(r.input_case(), v1::GenerateRequest::INPUT_NOT_SET) << entry.path();
    } else if (call == "infinigen.v1.Generation.Tokenize") {
      v1::TokenizeRequest r;
      ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(data, &r, strict).ok())
          << entry.path();
    } else {
      ADD_FAILURE() << entry.path() << " calls an unknown method " << call;
    }
    EXPECT_TRUE(std::filesystem::exists(entry.path().parent_path() /
                                        config.at("proto").get<std::string>()));
    ++checked;
  }
  EXPECT_GE(checked, 3);
}

}  // namespace
}  // namespace infinigen
