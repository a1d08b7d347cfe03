// The offline math of InfiniGen's skewing (INFINIGEN.md, "Offline preparation"): an orthogonal
// rotation A of a KV head's query/key space from the SVD of its query rows, and the few
// channels of the rotated space that carry most of q·k.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace infinigen {

// Eigen-decomposition of a symmetric n x n matrix (row-major) by cyclic Jacobi rotations.
// Returns eigenvalues in descending order; `vectors` (n x n, row-major) gets the matching
// eigenvectors as columns.
std::vector<double> SymmetricEigen(std::vector<double> matrix, int n, std::vector<double>& vectors);

// Accumulates the Gram matrix Σ rowᵀ·row of query rows (d x d, double).
class GramAccumulator {
 public:
  explicit GramAccumulator(int d) : d_(d), gram_(static_cast<size_t>(d) * d, 0.0) {}
  void Add(const float* row);
  int dim() const { return d_; }
  const std::vector<double>& gram() const { return gram_; }

 private:
  int d_;
  std::vector<double> gram_;
};

// The skew of one KV head: A's columns are the right singular vectors of the stacked query
// rows (the eigenvectors of their Gram matrix), by decreasing singular value. Returns A as a
// d x d row-major float matrix (x · A rotates a row x).
std::vector<float> SkewFromGram(const GramAccumulator& gram);

// How partial channels are ranked.
enum class ChannelRule {
  kSumAbs,   // Σ|Q·A| + Σ|K·A| over the calibration rows (the paper's rule)
  kProduct,  // mean|Q·A| x mean|K·A|: a channel's typical share of q·k
};

// Per-channel magnitudes of rotated query and key rows, accumulated over calibration rows.
class ChannelScores {
 public:
  ChannelScores(int d, const std::vector<float>& skew)
      : d_(d), skew_(skew), q_(d, 0.0), k_(d, 0.0) {}
  void AddQuery(const float* row) { Add(row, q_, q_rows_); }
  void AddKey(const float* row) { Add(row, k_, k_rows_); }
  // The `count` best channels by `rule`, ascending.
  std::vector<int32_t> Top(int count, ChannelRule rule = ChannelRule::kSumAbs) const;
  // The count / 2 best whole pairs {c, partner(c)} by the sum of their channels' scores: the
  // first members (the smaller channel of each pair) ascending, then their partners in the same
  // order. count must be even; partner must pair the channels up.
  std::vector<int32_t> TopPairs(int count, ChannelRule rule,
                                const std::function<int(int)>& partner) const;

 private:
  std::vector<double> Scores(ChannelRule rule) const;
  void Add(const float* row, std::vector<double>& sums, int64_t& rows);

  int d_;
  std::vector<float> skew_;
  std::vector<double> q_, k_;
  int64_t q_rows_ = 0, k_rows_ = 0;
  std::vector<double> rotated_;
};

}  // namespace infinigen
