// SPDX-License-Identifier: Apache-2.0
// Context parallelism's ring attention (cp/ring_attention.hpp) against the host attention op on the
// whole sequence, in float64: outputs, log-sum-exps and the gradient of q, k and v to 1e-12, for 1 to
// 4 ranks and both splits; the zigzag split's causal work equal on every rank, the contiguous one's
// not; the refusals.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cupipe/backend/host/ops.hpp"
#include "cupipe/cp/ring_attention.hpp"
#include "gradcheck.hpp"

using namespace cupipe;
using cupipe::testing::relative_error;
using cupipe::testing::uniform_values;

namespace {

using Vec = std::vector<double>;

/// One sequence of `seq_len` rows through the op (whole) and through a ring of `cp` ranks.
void check_ring(int cp, cp::Split split, std::uint64_t seed) {
  constexpr index_t C = 8, heads = 2, W = 3 * C, seq_len = 24;
  Rng rng(seed);
  Vec qkv = uniform_values(std::size_t(seq_len * W), rng, -2, 2);  // scores of a few units: softmaxes far from uniform
  const Vec dout = uniform_values(std::size_t(seq_len * C), rng);
  backend::Host<double> be;
  Vec out(std::size_t(seq_len * C)), lse(std::size_t(seq_len * heads)), dqkv(qkv.size());
  ops::causal_attention_forward(be, ConstView<double>{qkv.data(), Shape{seq_len, W}}, TensorView<double>{out.data(), Shape{seq_len, C}},
                                TensorView<double>{lse.data(), Shape{seq_len, heads}}, heads, seq_len);
  ops::causal_attention_backward(be, ConstView<double>{qkv.data(), Shape{seq_len, W}}, ConstView<double>{out.data(), Shape{seq_len, C}},
                                 ConstView<double>{lse.data(), Shape{seq_len, heads}}, ConstView<double>{dout.data(), Shape{seq_len, C}},
                                 TensorView<double>{dqkv.data(), Shape{seq_len, W}}, heads, seq_len);
  Vec ring_out(out.size()), ring_lse(lse.size()), ring_dqkv(dqkv.size());
  cp::RingWork forward, backward;
  cp::ring_forward(qkv.data(), seq_len, C, heads, cp, split, ring_out.data(), ring_lse.data(), &forward);
  cp::ring_backward(qkv.data(), seq_len, C, heads, cp, split, ring_out.data(), ring_lse.data(), dout.data(), ring_dqkv.data(),
                    &backward);
  INFO("cp = " << cp << (split == cp::Split::zigzag ? ", zigzag" : ", contiguous"));
  CHECK(relative_error(ring_out, out) <= 1e-12);
  CHECK(relative_error(ring_lse, lse) <= 1e-12);
  CHECK(relative_error(ring_dqkv, dqkv) <= 1e-12);
  // The blocks each rank ran cover the causal pairs of its chunks, and all of them together every pair.
  double total = 0;
  for (int r = 0; r < cp; ++r) {
    CHECK(forward.pairs[std::size_t(r)] == cp::causal_pairs(r, cp, seq_len, split));
    CHECK(backward.pairs[std::size_t(r)] == forward.pairs[std::size_t(r)]);
    total += forward.pairs[std::size_t(r)];
  }
  CHECK(total == double(seq_len * (seq_len + 1) / 2));
}

}  // namespace

TEST_CASE("Ring attention over 1 to 4 ranks equals the attention op on the whole sequence, forward and backward",
          "[cpu][layers][cp]") {
  for (int cp = 1; cp <= 4; ++cp) {
    check_ring(cp, cp::Split::zigzag, 100 + std::uint64_t(cp));
    check_ring(cp, cp::Split::contiguous, 200 + std::uint64_t(cp));
  }
}

TEST_CASE("Ring attention: the zigzag split balances the causal work, the contiguous one does not", "[cpu][layers][cp]") {
  const auto busiest_over_mean = [](int cp, cp::Split split) {
    double most = 0, sum = 0;
    for (int r = 0; r < cp; ++r) {
      const double p = cp::causal_pairs(r, cp, 4096, split);
      most = std::max(most, p);
      sum += p;
    }
    return most / (sum / cp);
  };
  for (int cp = 2; cp <= 8; cp *= 2) {
    CHECK(busiest_over_mean(cp, cp::Split::zigzag) == 1.0);
    // Rank cp - 1 holds the two last chunks: about 2 - 1 / cp times the mean for large chunks.
    CHECK(busiest_over_mean(cp, cp::Split::contiguous) > 1.2);
  }
  CHECK(busiest_over_mean(4, cp::Split::contiguous) == Approx(1.75).epsilon(1e-3));
  CHECK(cp::chunks_of(1, 4) == std::array<int, 2>{1, 6});
  CHECK(cp::chunks_of(1, 4, cp::Split::contiguous) == std::array<int, 2>{2, 3});
  CHECK(cp::ring_source(0, 1, 4) == 3);
  CHECK_THROWS_WITH(cp::chunk_rows(10, 4), Catch::Contains("a sequence of 10 tokens does not cut into 8 equal chunks for 4 ranks"));
  CHECK_THROWS_WITH(cp::chunks_of(4, 4), Catch::Contains("rank 4 of 4 ranks"));
}
