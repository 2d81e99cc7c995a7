// SPDX-License-Identifier: Apache-2.0
// The quick start: a 3-stage MLP 10 -> 50 -> 20 -> 2 trained with 1F1B on the CPU, batch 8 in
// microbatches of 4. Every figure it prints is measured during the step it describes.
#include <cstdio>
#include <vector>

#include "cupipe/cupipe.hpp"

using namespace cupipe;

using Model = Sequential<Linear<10, 50>, ReLU, Linear<50, 20>, ReLU, Linear<20, 2>>;
using Stages = partition<Model, 3>;
using Pipe = Pipeline<Stages, schedule::OneFOneB, backend::Host<float>>;

static_assert(schedule::verify<schedule::OneFOneB>(3, 2), "1F1B on 3 stages with 2 microbatches must verify");

int main() {
  try {
    constexpr index_t batch = 8, microbatch = 4;
    backend::Host<float>::set_blas_threads(1);  // 3 workers share the cores: one BLAS thread each
    Pipe pipe({.microbatches = int(batch / microbatch), .seed = 42});
    optim::AdamW optimizer({.lr = 1e-2});

    // A toy task with a learnable rule: the label says whether the first feature exceeds the second.
    Rng rng(7);
    std::vector<float> x(static_cast<std::size_t>(batch * 10));
    std::vector<std::int32_t> y(static_cast<std::size_t>(batch));
    for (index_t i = 0; i < batch; ++i) {
      for (index_t j = 0; j < 10; ++j) x[std::size_t(i * 10 + j)] = float(rng.normal());
      y[std::size_t(i)] = x[std::size_t(i * 10)] > x[std::size_t(i * 10 + 1)];
    }
    const ConstView<float> xv{x.data(), Shape{batch, 10}};
    const ConstView<std::int32_t> yv{y.data(), Shape{batch}};

    StepStats stats;
    for (int step = 0; step < 20; ++step) stats = pipe.train_step(xv, yv, optimizer);

    std::vector<float> out(static_cast<std::size_t>(batch * 2));
    const TensorView<float> outv{out.data(), Shape{batch, 2}};
    pipe.predict(xv, outv);
    std::printf("stages: %s | %s | %s\n", Stages::stage<0>::describe().c_str(), Stages::stage<1>::describe().c_str(),
                Stages::stage<2>::describe().c_str());
    std::printf("output shape: %s\n", outv.shape().to_string().c_str());
    std::printf("loss after 20 steps: %.4f\n", stats.loss);
    std::printf("bubble fraction (measured, last step): %.3f\n", stats.bubble_fraction);
    for (int s = 0; s < Pipe::stages; ++s)
      std::printf("stage %d utilisation (measured): %.1f%%, peak activations (measured): %lld bytes, weights: %lld bytes\n",
                  s, 100 * stats.utilisation(s), (long long)stats.peak_activation_bytes[std::size_t(s)],
                  (long long)stats.peak_weight_bytes[std::size_t(s)]);
    return 0;
  } catch (const cupipe::error& e) {
    std::fprintf(stderr, "quickstart: %s\n", e.what());
    return 1;
  }
}
