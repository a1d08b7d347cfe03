// The CLI's flag parser (cli/flags.h): each flag has one value whichever way its name is spelled
// (dashes as declared, or underscores as the service binaries spell theirs), and anything it
// does not know is an error naming it.
#include <gtest/gtest.h>

#include "cli/flags.h"

namespace infinigen::cli {
namespace {

absl::StatusOr<bool> Parse(FlagSet& flags, std::vector<std::string> args) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return flags.Parse(static_cast<int>(argv.size()), argv.data());
}

TEST(CliFlags, DashesAndUnderscoresNameTheSameFlag) {
  int64_t limit = 4096, port = 0;
  std::string listen;
  bool verbose = false;
  FlagSet flags("serve", "", "");
  flags.Int("max-new-tokens-limit", &limit, "");
  flags.Int("metrics-port", &port, "");
  flags.String("http-listen", &listen, "");
  flags.Bool("verbose", &verbose, "");
  auto parsed = Parse(flags, {"--max_new_tokens_limit=240", "--metrics-port", "9090",
                              "--http_listen", "127.0.0.1:8000", "--verbose"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(*parsed);
  EXPECT_EQ(limit, 240);
  EXPECT_EQ(port, 9090);
  EXPECT_EQ(listen, "127.0.0.1:8000");
  EXPECT_TRUE(verbose);
  EXPECT_TRUE(flags.WasSet("max-new-tokens-limit"));
}

TEST(CliFlags, UnknownAndMalformedFlagsAreNamed) {
  int64_t limit = 0;
  FlagSet flags("serve", "", "");
  flags.Int("max-new-tokens-limit", &limit, "");
  auto unknown = Parse(flags, {"--max_new_token_limit=3"});
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("--max_new_token_limit"), std::string::npos);
  auto bad = Parse(flags, {"--max_new_tokens_limit=many"});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'many'"), std::string::npos);
  EXPECT_EQ(Parse(flags, {"--max-new-tokens-limit"}).status().code(),
            absl::StatusCode::kInvalidArgument);  // no value
}

}  // namespace
}  // namespace infinigen::cli
