// StopStringFilter: stop strings split across deltas are found, text that might begin one is
// held back and released when it does not, and nothing is sent after a stop.
#include "frontend/stop_strings.h"

#include <gtest/gtest.h>

#include <random>

namespace infinigen {
namespace {

// Feeds `deltas` and returns everything sent, and whether it stopped.
std::pair<std::string, bool> FilterAll(const std::vector<std::string>& stops,
                                       const std::vector<std::string>& deltas) {
  StopStringFilter f(stops);
  std::string out;
  for (const auto& d : deltas) out += f.Add(d);
  out += f.Finish();
  return {out, f.stopped()};
}

TEST(StopStrings, NoStopsPassesEverything) {
  EXPECT_EQ(FilterAll({}, {"a", "b", "c"}), std::make_pair(std::string("abc"), false));
}

TEST(StopStrings, StopInsideOneDelta) {
  EXPECT_EQ(FilterAll({"END"}, {"hello END world"}), std::make_pair(std::string("hello "), true));
}

TEST(StopStrings, StopSplitAcrossDeltasIsNeverHalfSent) {
  StopStringFilter f({"\nUser:"});
  EXPECT_EQ(f.Add("Sure.\n"), "Sure.");  // "\n" might begin the stop string
  EXPECT_EQ(f.Add("Us"), "");
  EXPECT_EQ(f.Add("er:"), "");
  EXPECT_TRUE(f.stopped());
  EXPECT_EQ(f.Add("more"), "");
  EXPECT_EQ(f.Finish(), "");
}

TEST(StopStrings, HeldTextIsReleasedWhenItDoesNotMatch) {
  StopStringFilter f({"abc"});
  EXPECT_EQ(f.Add("xab"), "x");
  EXPECT_EQ(f.Add("d"), "abd");
  EXPECT_EQ(f.Add("ab"), "");
  EXPECT_EQ(f.Finish(), "ab");
  EXPECT_FALSE(f.stopped());
}

TEST(StopStrings, EarliestOfSeveralWins) {
  EXPECT_EQ(FilterAll({"world", "lo w"}, {"hel", "lo world"}),
            std::make_pair(std::string("hel"), true));
}

TEST(StopStrings, SaysWhichStopMatchedAndCanIncludeIt) {
  StopStringFilter f({"world", "lo w"});
  EXPECT_EQ(f.matched(), "");
  EXPECT_EQ(f.Add("hel"), "he");  // "l" might begin "lo w"
  EXPECT_EQ(f.Add("lo world"), "l");
  EXPECT_EQ(f.matched(), "lo w");
  StopStringFilter with({"\n\n", "END"}, /*include_stop=*/true);
  EXPECT_EQ(with.Add("one\n"), "one");
  EXPECT_EQ(with.Add("\nrest"), "\n\n");
  EXPECT_TRUE(with.stopped());
  EXPECT_EQ(with.matched(), "\n\n");
  EXPECT_EQ(with.Finish(), "");
}

TEST(StopStrings, AnySplitGivesTheSameResultAsWholeText) {
  std::mt19937 rng(3);
  const std::string text = "one two three. four five\n\nsix seven eight nine ten";
  const std::vector<std::string> stops = {"\n\n", "nine", "xyz"};
  const auto whole = FilterAll(stops, {text});
  EXPECT_EQ(whole.first, "one two three. four five");
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<std::string> deltas;
    for (size_t i = 0; i < text.size();) {
      const size_t n = std::min<size_t>(text.size() - i, rng() % 4);
      deltas.push_back(text.substr(i, n));
      i += n;
    }
    EXPECT_EQ(FilterAll(stops, deltas), whole);
  }
}

TEST(StopStrings, Validation) {
  EXPECT_TRUE(ValidateStopStrings({"a", "b"}, "stop_strings").ok());
  auto st = ValidateStopStrings({""}, "stopping.stop_strings");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("stopping.stop_strings"), std::string::npos);
  EXPECT_FALSE(ValidateStopStrings(std::vector<std::string>(9, "x"), "s").ok());
  EXPECT_FALSE(ValidateStopStrings({std::string(300, 'x')}, "s").ok());
}

}  // namespace
}  // namespace infinigen
