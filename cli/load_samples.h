// What `infinigen load` drives and gathers, shared by its gRPC and HTTP drivers
// (cli/load_command.cc, cli/openai_load.cc).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace infinigen::cli {

struct LoadSpec {
  int64_t prompt_tokens = 32, max_tokens = 32, vocab = 0;
  double temperature = 0.0;
  double timeout_seconds = 120;  // a request still running this long after the end fails
  // The mix (gRPC APIs): fractions of requests that the client cancels after a few tokens, that
  // carry a deadline shorter than their generation, and that are malformed (a token id outside
  // the vocabulary). Their failures (CANCELLED, DEADLINE_EXCEEDED, INVALID_ARGUMENT) are
  // expected, counted apart from errors.
  double cancel_fraction = 0, deadline_fraction = 0, malformed_fraction = 0;
  std::string text;
  absl::Time end;
};

struct Samples {
  std::mutex mu;
  int64_t ok = 0, tokens = 0;
  std::map<std::string, int64_t> errors;
  std::map<std::string, int64_t> expected;  // failures the mix asked for, by kind and code
  std::vector<double> ttft, gaps;           // seconds

  // Adds one stream's results.
  void Merge(int64_t stream_ok, int64_t stream_tokens,
             const std::map<std::string, int64_t>& stream_errors,
             const std::vector<double>& stream_ttft, const std::vector<double>& stream_gaps,
             const std::map<std::string, int64_t>& stream_expected = {}) {
    std::lock_guard<std::mutex> l(mu);
    ok += stream_ok;
    tokens += stream_tokens;
    for (const auto& [k, v] : stream_errors) errors[k] += v;
    for (const auto& [k, v] : stream_expected) expected[k] += v;
    ttft.insert(ttft.end(), stream_ttft.begin(), stream_ttft.end());
    gaps.insert(gaps.end(), stream_gaps.begin(), stream_gaps.end());
  }
};

}  // namespace infinigen::cli
