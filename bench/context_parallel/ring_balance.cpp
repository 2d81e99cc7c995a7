// SPDX-License-Identifier: Apache-2.0
// The busiest rank's attention time against the mean, for a ring of cp ranks (cp/ring_attention.hpp)
// under the zigzag and the contiguous split: each rank's blocks (forward, then backward) timed on
// their own, one rank after another on one core, the median of 5 runs per rank. The work each
// split deals (causal pairs) is printed beside it: the time should follow it.
#include <algorithm>
#include <cstdio>
#include <vector>

#include "cupipe/backend/host/host.hpp"
#include "cupipe/core/rng.hpp"
#include "cupipe/cp/ring_attention.hpp"

using namespace cupipe;

namespace {

double busiest_over_mean(const std::vector<double>& v) {
  double sum = 0;
  for (const double x : v) sum += x;
  return *std::max_element(v.begin(), v.end()) / (sum / double(v.size()));
}

}  // namespace

int main() {
  backend::Host<float>::set_blas_threads(1);
  constexpr index_t C = 256, heads = 4, seq_len = 2048, W = 3 * C;
  Rng rng(1);
  std::vector<float> qkv(std::size_t(seq_len * W)), dout(std::size_t(seq_len * C));
  for (float& v : qkv) v = float(rng.normal());
  for (float& v : dout) v = float(rng.normal());
  std::vector<float> out(dout.size()), lse(std::size_t(seq_len * heads)), dqkv(qkv.size());
  std::printf("ring attention, T %lld, C %lld, %lld heads, fp32, one core; each rank's forward + backward, median of 5\n",
              (long long)seq_len, (long long)C, (long long)heads);
  std::printf("%4s  %-10s  %12s  %12s  %s\n", "cp", "split", "pairs max/mean", "time max/mean", "per-rank ms");
  for (const int cp : {2, 4, 8})
    for (const cp::Split split : {cp::Split::zigzag, cp::Split::contiguous}) {
      std::vector<std::vector<double>> runs(static_cast<std::size_t>(cp));
      cp::RingWork forward, backward;
      for (int run = 0; run < 5; ++run) {
        cp::ring_forward(qkv.data(), seq_len, C, heads, cp, split, out.data(), lse.data(), &forward);
        cp::ring_backward(qkv.data(), seq_len, C, heads, cp, split, out.data(), lse.data(), dout.data(), dqkv.data(), &backward);
        for (int r = 0; r < cp; ++r) runs[std::size_t(r)].push_back(forward.seconds[std::size_t(r)] + backward.seconds[std::size_t(r)]);
      }
      std::vector<double> seconds;
      for (std::vector<double>& r : runs) {
        std::sort(r.begin(), r.end());
        seconds.push_back(r[r.size() / 2]);
      }
      std::printf("%4d  %-10s  %12.3f  %12.3f  ", cp, split == cp::Split::zigzag ? "zigzag" : "contiguous",
                  busiest_over_mean(forward.pairs), busiest_over_mean(seconds));
      for (const double s : seconds) std::printf(" %.1f", s * 1e3);
      std::printf("\n");
    }
  return 0;
}
