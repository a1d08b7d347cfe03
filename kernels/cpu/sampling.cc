#include "kernels/cpu/sampling.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/philox.h"

namespace infinigen {

int32_t SampleToken(std::span<float> logits, const SamplingParams& params,
                    std::span<const int32_t> history, std::span<const int32_t> output,
                    uint64_t position, SamplingScratch& scratch) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  if (params.repetition_penalty != 1.0f && !history.empty()) {
    // Once per distinct token; the marks go back to zero after (the history is shorter than
    // the vocabulary to clear, mostly).
    if (scratch.seen.size() < static_cast<size_t>(vocab)) scratch.seen.assign(vocab, 0);
    for (int32_t id : history) {
      if (id < 0 || id >= vocab || scratch.seen[id]) continue;
      scratch.seen[id] = 1;
      float& l = logits[id];
      l = l > 0.0f ? l / params.repetition_penalty : l * params.repetition_penalty;
    }
    for (int32_t id : history) {
      if (id >= 0 && id < vocab) scratch.seen[id] = 0;
    }
  }
  if (params.penalizes_output() && !output.empty()) {
    // logit -= frequency x count + presence, once per distinct token (vLLM's and OpenAI's
    // formula); the counts go back to zero as they are used.
    if (scratch.counts.size() < static_cast<size_t>(vocab)) scratch.counts.assign(vocab, 0);
    for (int32_t id : output) {
      if (id >= 0 && id < vocab) ++scratch.counts[id];
    }
    for (int32_t id : output) {
      if (id < 0 || id >= vocab || scratch.counts[id] == 0) continue;
      logits[id] -= params.frequency_penalty * static_cast<float>(scratch.counts[id]) +
                    params.presence_penalty;
      scratch.counts[id] = 0;
    }
  }
  if (params.greedy()) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }

  // Candidates sorted by logit, descending (ties: lower id first, so results are stable).
  auto& cand = scratch.candidates;
  cand.clear();
  const float inv_t = 1.0f / params.temperature;
  for (int64_t i = 0; i < vocab; ++i) cand.emplace_back(logits[i] * inv_t, static_cast<int32_t>(i));
  auto by_logit = [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  size_t keep = cand.size();
  if (params.top_k > 0 && static_cast<size_t>(params.top_k) < keep) {
    std::nth_element(cand.begin(), cand.begin() + params.top_k - 1, cand.end(), by_logit);
    const float kth = cand[params.top_k - 1].first;
    // Hugging Face keeps every token tied with the k-th.
    auto mid =
        std::partition(cand.begin(), cand.end(), [kth](const auto& c) { return c.first >= kth; });
    keep = mid - cand.begin();
  }
  std::sort(cand.begin(), cand.begin() + keep, by_logit);

  // Probabilities of the kept candidates (in `first` from here on).
  const float max_logit = cand[0].first;
  double sum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    cand[i].first = std::exp(cand[i].first - max_logit);
    sum += cand[i].first;
  }
  for (size_t i = 0; i < keep; ++i) cand[i].first = static_cast<float>(cand[i].first / sum);

  if (params.top_p < 1.0f) {
    double cum = 0.0;
    size_t n = 0;
    while (n < keep) {
      cum += cand[n].first;
      ++n;
      if (cum >= params.top_p) break;
    }
    keep = std::max<size_t>(n, 1);
  }
  if (params.min_p > 0.0f) {
    const float threshold = params.min_p * cand[0].first;
    size_t n = 1;
    while (n < keep && cand[n].first >= threshold) ++n;
    keep = n;
  }

  double total = 0.0;
  for (size_t i = 0; i < keep; ++i) total += cand[i].first;
  const double u = UniformForPosition(params.seed, position) * total;
  double cum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    cum += cand[i].first;
    if (u < cum) return cand[i].second;
  }
  return cand[keep - 1].second;
}

void ComputeLogprobs(std::span<const float> logits, int32_t token, int top, TokenLogprobs& out) {
  const int64_t n = static_cast<int64_t>(logits.size());
  float mx = -INFINITY;
  for (float l : logits) mx = std::max(mx, l);
  double sum = 0.0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - mx);
  const double lse = static_cast<double>(mx) + std::log(sum);
  out.logprob = token >= 0 && token < n ? static_cast<float>(logits[token] - lse) : -INFINITY;
  out.rank = 0;
  if (token >= 0 && token < n) {
    const float l = logits[token];
    int64_t before = 0;
    for (int64_t i = 0; i < n; ++i) before += logits[i] > l || (logits[i] == l && i < token);
    out.rank = before + 1;
  }
  out.top.clear();
  const int64_t k = std::clamp<int64_t>(top, 0, n);
  if (k == 0) return;
  // The k best by (logit descending, id ascending), kept sorted in a small array.
  for (int64_t i = 0; i < n; ++i) {
    const float l = logits[i];
    if (static_cast<int64_t>(out.top.size()) == k && !(l > logits[out.top.back().first])) continue;
    auto at = std::upper_bound(out.top.begin(), out.top.end(), l,
                               [&](float v, const auto& e) { return v > logits[e.first]; });
    out.top.insert(at, {static_cast<int32_t>(i), 0.0f});
    if (static_cast<int64_t>(out.top.size()) > k) out.top.pop_back();
  }
  for (auto& [id, lp] : out.top) lp = static_cast<float>(logits[id] - lse);
}

}  // namespace infinigen
