// The flag parser every program uses (common/flags.h, through cli/flags.h here): each flag has
// one value whichever way its name is spelled (dashes as declared, or underscores), flag files
// are read in place (later values win, nested files too), durations bind in their unit, and
// anything it does not know is an error naming it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

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

// The path of `name` in the temporary directory, unique to this process.
std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() / (std::to_string(getpid()) + "_" + name))
      .string();
}

// TempPath(name), holding `text`.
std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = TempPath(name);
  std::ofstream(path) << text;
  return path;
}

TEST(CliFlags, FlagFilesAreReadInPlaceAndLaterValuesWin) {
  int64_t limit = 0, port = 0;
  absl::Duration stall = absl::ZeroDuration(), ttl = absl::ZeroDuration();
  bool gather = true;
  FlagSet flags("infinigen-test", "", "");
  flags.Int("max-new-tokens-limit", &limit, "");
  flags.Int("metrics-port", &port, "");
  flags.Milliseconds("stall-timeout-ms", &stall, "");
  flags.Seconds("session-ttl-seconds", &ttl, "");
  flags.Bool("kv-device-gather", &gather, "");
  const std::string inner = WriteFile("flags_test_inner.flags", "--metrics_port=9091\n");
  const std::string a =
      WriteFile("flags_test_a.flags",
                "# the base\n--max_new_tokens_limit=4096\n\n  --metrics_port=9090\n"
                "--stall_timeout_ms=1500\n--kv_device_gather=false\n");
  const std::string b =
      WriteFile("flags_test_b.flags", "--max_new_tokens_limit=240\n--flagfile=" + inner + "\n");
  auto parsed = Parse(flags, {"--flagfile=" + a + "," + b, "--session-ttl-seconds", "30"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(limit, 240);  // b after a
  EXPECT_EQ(port, 9091);  // the file b names, read where b names it
  EXPECT_EQ(stall, absl::Milliseconds(1500));
  EXPECT_EQ(ttl, absl::Seconds(30));
  EXPECT_FALSE(gather);
  // The command line after a flag file overrides it.
  parsed = Parse(flags, {"--flagfile", a, "--max-new-tokens-limit=7"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(limit, 7);
  for (const std::string& f : {inner, a, b}) std::filesystem::remove(f);
}

TEST(CliFlags, BadFlagFilesAreNamed) {
  int64_t limit = 0;
  FlagSet flags("infinigen-test", "", "");
  flags.Int("max-new-tokens-limit", &limit, "");
  auto missing = Parse(flags, {"--flagfile=/no/such/file.flags"});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/no/such/file.flags"), std::string::npos);
  const std::string bad = WriteFile("flags_test_bad.flags", "--max_new_tokens_limit=lots\n");
  auto malformed = Parse(flags, {"--flagfile=" + bad});
  EXPECT_EQ(malformed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(malformed.status().message().find(bad), std::string::npos) << malformed.status();
  EXPECT_NE(malformed.status().message().find("'lots'"), std::string::npos);
  const std::string loop = TempPath("flags_test_loop.flags");
  WriteFile("flags_test_loop.flags", "--flagfile=" + loop + "\n");
  auto cycle = Parse(flags, {"--flagfile=" + loop});
  EXPECT_EQ(cycle.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(cycle.status().message().find("deeper"), std::string::npos) << cycle.status();
  for (const std::string& f : {bad, loop}) std::filesystem::remove(f);
}

TEST(CliFlags, HelpListsTheProgramsFlags) {
  int64_t limit = 4096;
  FlagSet flags("infinigen-test", "[flags]", "A test program.");
  flags.Int("max-new-tokens-limit", &limit, "the most tokens");
  const std::string help = flags.Help();
  EXPECT_NE(help.find("usage: infinigen-test [flags]"), std::string::npos) << help;
  EXPECT_NE(help.find("--max-new-tokens-limit N"), std::string::npos) << help;
  EXPECT_NE(help.find("(default: 4096)"), std::string::npos) << help;
  EXPECT_NE(help.find("--flagfile"), std::string::npos) << help;
}

}  // namespace
}  // namespace infinigen::cli
