#include "gpu_worker/infinigen/skew.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace infinigen {

std::vector<double> SymmetricEigen(std::vector<double> a, int n, std::vector<double>& v) {
  v.assign(static_cast<size_t>(n) * n, 0.0);
  for (int i = 0; i < n; ++i) v[i * n + i] = 1.0;
  auto at = [&](int r, int c) -> double& { return a[static_cast<size_t>(r) * n + c]; };
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0.0, total = 0.0;
    for (int r = 0; r < n; ++r) {
      for (int c = 0; c < n; ++c) {
        total += at(r, c) * at(r, c);
        if (r != c) off += at(r, c) * at(r, c);
      }
    }
    if (off <= 1e-22 * total) break;
    for (int p = 0; p < n - 1; ++p) {
      for (int q = p + 1; q < n; ++q) {
        const double apq = at(p, q);
        if (std::abs(apq) < 1e-300) continue;
        // Rotation that zeroes a[p][q] (Golub & Van Loan, symmetric Schur decomposition).
        const double tau = (at(q, q) - at(p, p)) / (2.0 * apq);
        const double t = (tau >= 0 ? 1.0 : -1.0) / (std::abs(tau) + std::sqrt(1.0 + tau * tau));
        const double c = 1.0 / std::sqrt(1.0 + t * t), s = t * c;
        for (int k = 0; k < n; ++k) {  // columns p, q
          const double akp = at(k, p), akq = at(k, q);
          at(k, p) = c * akp - s * akq;
          at(k, q) = s * akp + c * akq;
        }
        for (int k = 0; k < n; ++k) {  // rows p, q
          const double apk = at(p, k), aqk = at(q, k);
          at(p, k) = c * apk - s * aqk;
          at(q, k) = s * apk + c * aqk;
        }
        for (int k = 0; k < n; ++k) {
          const double vkp = v[k * n + p], vkq = v[k * n + q];
          v[k * n + p] = c * vkp - s * vkq;
          v[k * n + q] = s * vkp + c * vkq;
        }
      }
    }
  }
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int x, int y) { return at(x, x) > at(y, y); });
  std::vector<double> values(n), sorted(static_cast<size_t>(n) * n);
  for (int j = 0; j < n; ++j) {
    values[j] = at(order[j], order[j]);
    for (int k = 0; k < n; ++k) sorted[k * n + j] = v[k * n + order[j]];
  }
  v.swap(sorted);
  return values;
}

void GramAccumulator::Add(const float* row) {
  for (int i = 0; i < d_; ++i) {
    const double ri = row[i];
    double* g = gram_.data() + static_cast<size_t>(i) * d_;
    for (int j = 0; j < d_; ++j) g[j] += ri * row[j];
  }
}

std::vector<float> SkewFromGram(const GramAccumulator& gram) {
  std::vector<double> vectors;
  SymmetricEigen(gram.gram(), gram.dim(), vectors);
  return std::vector<float>(vectors.begin(), vectors.end());
}

void ChannelScores::Add(const float* row, std::vector<double>& sums, int64_t& rows) {
  rotated_.assign(d_, 0.0);
  for (int i = 0; i < d_; ++i) {
    const double ri = row[i];
    const float* a = skew_.data() + static_cast<size_t>(i) * d_;
    for (int j = 0; j < d_; ++j) rotated_[j] += ri * a[j];
  }
  for (int j = 0; j < d_; ++j) sums[j] += std::abs(rotated_[j]);
  ++rows;
}

std::vector<double> ChannelScores::Scores(ChannelRule rule) const {
  std::vector<double> score(d_);
  for (int j = 0; j < d_; ++j) {
    score[j] = rule == ChannelRule::kSumAbs ? q_[j] + k_[j]
                                            : (q_[j] / std::max<int64_t>(q_rows_, 1)) *
                                                  (k_[j] / std::max<int64_t>(k_rows_, 1));
  }
  return score;
}

std::vector<int32_t> ChannelScores::TopPairs(int count, ChannelRule rule,
                                             const std::function<int(int)>& partner) const {
  const std::vector<double> score = Scores(rule);
  std::vector<int32_t> firsts;
  for (int c = 0; c < d_; ++c) {
    if (c < partner(c)) firsts.push_back(c);
  }
  std::stable_sort(firsts.begin(), firsts.end(), [&](int32_t a, int32_t b) {
    return score[a] + score[partner(a)] > score[b] + score[partner(b)];
  });
  firsts.resize(std::min<size_t>(firsts.size(), count / 2));
  std::sort(firsts.begin(), firsts.end());
  std::vector<int32_t> out = firsts;
  for (int32_t c : firsts) out.push_back(partner(c));
  return out;
}

std::vector<int32_t> ChannelScores::Top(int count, ChannelRule rule) const {
  const std::vector<double> score = Scores(rule);
  std::vector<int32_t> idx(d_);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(),
                   [&](int32_t a, int32_t b) { return score[a] > score[b]; });
  idx.resize(count);
  std::sort(idx.begin(), idx.end());
  return idx;
}

}  // namespace infinigen
