// Cuts a stream of text deltas at the first of a set of stop strings. Text that could still be
// the start of a stop string is held back until a later delta decides, so a stop string split
// across tokens is found and never half sent.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace infinigen {

class StopStringFilter {
 public:
  // At most kMaxStops strings, each 1..kMaxStopBytes bytes (ValidateStopStrings).
  static constexpr int kMaxStops = 8;
  static constexpr size_t kMaxStopBytes = 256;

  // `include_stop`: the text sent ends with the stop string that ended it (OpenAI's
  // include_stop_str_in_output); else it ends before it.
  explicit StopStringFilter(std::vector<std::string> stops, bool include_stop = false);

  // The text that can be sent now. Once a stop string is complete, returns the text before it
  // (and the stop string, with include_stop) and stopped() turns true; later deltas return
  // nothing. The stop string found earliest in the text wins (the first listed on a tie).
  std::string Add(absl::string_view delta);
  // The held-back text at the end of generation (nothing after a stop).
  std::string Finish();
  bool stopped() const { return stopped_; }
  // The stop string that ended the text ("" while none has).
  const std::string& matched() const { return matched_; }
  bool empty() const { return stops_.empty(); }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  std::string matched_;
  bool include_stop_ = false;
  bool stopped_ = false;
};

// INVALID_ARGUMENT naming `field` when there are too many stop strings or one is empty or long.
absl::Status ValidateStopStrings(const std::vector<std::string>& stops, absl::string_view field);

}  // namespace infinigen
