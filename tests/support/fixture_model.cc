#include "tests/support/fixture_model.h"

#include <gtest/gtest.h>

#include <random>

namespace infinigen::testing {

LoadedModel LoadModel(const std::string& dir) {
  LoadedModel l;
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  if (!ckpt.ok()) return l;
  l.ckpt = std::move(*ckpt);
  l.backend = std::make_unique<CpuBackend>();
  auto model = Model::Load(*l.ckpt, *l.backend);
  EXPECT_TRUE(model.ok()) << model.status();
  if (model.ok()) l.model = std::move(*model);
  return l;
}

std::vector<int32_t> RandomTokens(int64_t n, int64_t vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

}  // namespace infinigen::testing
