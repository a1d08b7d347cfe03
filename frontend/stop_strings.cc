#include "frontend/stop_strings.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace infinigen {

StopStringFilter::StopStringFilter(std::vector<std::string> stops, bool include_stop)
    : stops_(std::move(stops)), include_stop_(include_stop) {}

std::string StopStringFilter::Add(absl::string_view delta) {
  if (stopped_) return "";
  held_.append(delta.data(), delta.size());
  if (stops_.empty()) return std::exchange(held_, std::string());
  size_t first = std::string::npos;
  for (const std::string& s : stops_) {
    const size_t at = held_.find(s);
    if (at < first) {
      first = at;
      matched_ = s;
    }
  }
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, include_stop_ ? first + matched_.size() : first);
    held_.clear();
    return out;
  }
  // Hold back the longest tail of held_ that begins some stop string; stop strings are UTF-8,
  // so the cut falls on a character boundary.
  size_t keep = 0;
  for (const std::string& s : stops_) {
    for (size_t k = std::min(s.size() - 1, held_.size()); k > keep; --k) {
      if (absl::string_view(held_).substr(held_.size() - k) == absl::string_view(s).substr(0, k)) {
        keep = k;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopStringFilter::Finish() {
  if (stopped_) return "";
  return std::exchange(held_, std::string());
}

absl::Status ValidateStopStrings(const std::vector<std::string>& stops, absl::string_view field) {
  if (static_cast<int>(stops.size()) > StopStringFilter::kMaxStops) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", stops.size(), " stop strings; the limit is ", StopStringFilter::kMaxStops));
  }
  for (const std::string& s : stops) {
    if (s.empty() || s.size() > StopStringFilter::kMaxStopBytes) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": each stop string must have 1 to ",
                                                     StopStringFilter::kMaxStopBytes,
                                                     " bytes (one has ", s.size(), ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace infinigen
