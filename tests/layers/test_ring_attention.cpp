// SPDX-License-Identifier: Apache-2.0
// Context parallelism's ring attention (cp/ring_attention.hpp) against the host attention op on the
// whole sequence, in float64: outputs, log-sum-exps and the gradient of q, k and v to 1e-12, for 1 to
// 4 ranks and both splits; the zigzag split's causal work equal on every rank, the contiguous one's
// not; the refusals. Then the ring across ranks (cp/ring_layer.hpp), each rank a thread of an
// in-process ring: every rank's rows equal the oracle's rows it owns, forward bitwise (the same
// blocks merged in the same order), backward to 1e-12 (a chunk's key gradient adds round the ring
// in another order).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

#include "cupipe/backend/host/ops.hpp"
#include "cupipe/cp/ring_attention.hpp"
#include "cupipe/cp/ring_layer.hpp"
#include "gradcheck.hpp"
#include "local_ring.hpp"

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

namespace {

/// `sequences` sequences through ring_forward / ring_backward (the oracle) and through ring_attention_*
/// on `cp` threads, each with its local rows.
void check_threaded_ring(int cp, std::uint64_t seed) {
  constexpr index_t C = 8, heads = 2, W = 3 * C, seq_len = 16, sequences = 2, rows = sequences * seq_len;
  Rng rng(seed);
  const Vec qkv = uniform_values(std::size_t(rows * W), rng, -2, 2);
  const Vec dout = uniform_values(std::size_t(rows * C), rng);
  Vec out(std::size_t(rows * C)), lse(std::size_t(rows * heads)), dqkv(qkv.size());
  for (index_t s = 0; s < sequences; ++s) {
    cp::ring_forward(qkv.data() + s * seq_len * W, seq_len, C, heads, cp, cp::Split::zigzag, out.data() + s * seq_len * C,
                     lse.data() + s * seq_len * heads);
    cp::ring_backward(qkv.data() + s * seq_len * W, seq_len, C, heads, cp, cp::Split::zigzag, out.data() + s * seq_len * C,
                      lse.data() + s * seq_len * heads, dout.data() + s * seq_len * C, dqkv.data() + s * seq_len * W);
  }
  testing::LocalRing ring(cp);
  const auto size = std::size_t(cp);
  std::vector<Vec> got_out(size), got_lse(size), got_dqkv(size);
  std::vector<std::exception_ptr> failures(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < cp; ++r)
    threads.emplace_back([&, r] {
      try {
        testing::LocalRing::Rank group(ring, r);
        const Vec my_qkv = cp::local_rows(std::span<const double>(qkv), seq_len, r, cp, W);
        const Vec my_dout = cp::local_rows(std::span<const double>(dout), seq_len, r, cp, C);
        const index_t n = rows / cp;
        Vec& o = got_out[std::size_t(r)];
        Vec& l = got_lse[std::size_t(r)];
        Vec& d = got_dqkv[std::size_t(r)];
        o.resize(std::size_t(n * C));
        l.resize(std::size_t(n * heads));
        d.resize(std::size_t(n * W));
        cp::ring_attention_forward(group, my_qkv.data(), n, seq_len, C, heads, o.data(), l.data());
        cp::ring_attention_backward(group, my_qkv.data(), n, seq_len, C, heads, o.data(), l.data(), my_dout.data(), d.data());
      } catch (...) {
        failures[std::size_t(r)] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  for (const auto& f : failures)
    if (f) std::rethrow_exception(f);
  INFO("cp = " << cp);
  // cp - 1 passes of keys and values forward; backward cp - 1 more, and cp of their gradients.
  CHECK(ring.passes == 3 * cp - 2);
  for (int r = 0; r < cp; ++r) {
    INFO("rank " << r);
    CHECK(got_out[std::size_t(r)] == cp::local_rows(std::span<const double>(out), seq_len, r, cp, C));
    CHECK(got_lse[std::size_t(r)] == cp::local_rows(std::span<const double>(lse), seq_len, r, cp, heads));
    CHECK(relative_error(got_dqkv[std::size_t(r)], cp::local_rows(std::span<const double>(dqkv), seq_len, r, cp, W)) <= 1e-12);
  }
}

}  // namespace

TEST_CASE("Ring attention across 2 and 4 ranks: each rank's rows equal the oracle's, forward bitwise", "[cpu][layers][cp]") {
  check_threaded_ring(2, 31);
  check_threaded_ring(4, 32);
  // Local rows that are not whole shares of sequences are refused, naming the ring.
  testing::LocalRing ring(2);
  testing::LocalRing::Rank group(ring, 0);
  Vec qkv(std::size_t(6 * 24)), out(std::size_t(6 * 8)), lse(std::size_t(6 * 2));
  CHECK_THROWS_WITH(cp::ring_attention_forward(group, qkv.data(), 6, 16, 8, 2, out.data(), lse.data()),
                    Catch::Contains("6 rows are not whole sequences' shares (8 rows each: 16 tokens over a context-parallel ring of 2)"));
  // A ring of device memory (NCCL's) is the CUDA op's; the host's refuses it, saying so.
  testing::LocalRing device_ring(2, [](void*, const void*, std::size_t) {});
  testing::LocalRing::Rank device_rank(device_ring, 0);
  CHECK_THROWS_WITH(cp::ring_attention_forward(device_rank, qkv.data(), 8, 16, 8, 2, out.data(), lse.data()),
                    Catch::Contains("this ring passes device memory (NCCL's)"));
}

TEST_CASE("Context parallel: a rank's rows are its two zigzag chunks of each sequence, and their positions", "[cpu][layers][cp]") {
  const std::vector<int> tokens{0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17};
  CHECK(cp::local_rows(std::span<const int>(tokens), 8, 0, 2) == std::vector<int>{0, 1, 6, 7, 10, 11, 16, 17});
  CHECK(cp::local_rows(std::span<const int>(tokens), 8, 1, 2) == std::vector<int>{2, 3, 4, 5, 12, 13, 14, 15});
  std::vector<std::array<index_t, 3>> runs;
  cp::sequence_runs(8, 8, 1, 2, [&](index_t first, index_t position, index_t length) { runs.push_back({first, position, length}); });
  CHECK(runs == std::vector<std::array<index_t, 3>>{{0, 2, 2}, {2, 4, 2}, {4, 2, 2}, {6, 4, 2}});
  CHECK_THROWS_WITH(cp::local_rows(std::span<const int>(tokens), 6, 0, 2), Catch::Contains("16 values are not whole sequences of 6"));
}
