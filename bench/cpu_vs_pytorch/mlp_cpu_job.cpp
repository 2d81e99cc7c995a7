// SPDX-License-Identifier: Apache-2.0
// One measured run of the CPU training job bench/cpu_vs_pytorch compares with PyTorch: the
// Fashion-MNIST trainer's model (784-1024-512-256-10 MLP, ReLU, softmax cross-entropy) trained with
// AdamW (lr 1e-3, weight decay 1e-4), batch 128, in one pipeline stage, on the first --samples
// training images (standardised), with --threads BLAS threads. One untimed warm-up epoch, then
// --epochs timed epochs; prints one JSON line: samples/s, the mean loss of the last epoch.
//   mlp_cpu_job --threads 2 --samples 10000 --epochs 2 [--data DIR]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cupipe/cupipe.hpp"

using namespace cupipe;
using Model = Sequential<Linear<784, 1024>, ReLU, Linear<1024, 512>, ReLU, Linear<512, 256>, ReLU, Linear<256, 10>>;

int main(int argc, char** argv) {
  int threads = 1, epochs = 2;
  std::int64_t samples = 10000, batch = 128;
  std::string data = "/usr/share/datasets/fashion-mnist";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--epochs")) epochs = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--samples")) samples = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--data")) data = argv[i + 1];
  }
  try {
    CUPIPE_REQUIRE(threads >= 1 && epochs >= 1 && samples >= batch, "mlp_cpu_job: bad --threads, --epochs or --samples");
    backend::Host<float>::set_blas_threads(threads);
    io::FashionMnist set = io::load_fashion_mnist(data);
    io::Dataset train = io::take(set.train, 0, std::min(samples, set.train.count));
    double sum = 0, sq = 0;
    for (float v : train.images) {
      sum += v;
      sq += double(v) * v;
    }
    const double n = double(train.images.size()), mean = sum / n, stddev = std::sqrt(sq / n - mean * mean);
    for (float& v : train.images) v = float((v - mean) / stddev);

    Pipeline<partition<Model, 1>, schedule::GPipe, backend::Host<float>> pipe({.microbatches = 1, .seed = 0});
    const optim::AdamW adamw({.lr = 1e-3, .weight_decay = 1e-4});
    const std::int64_t steps = train.count / batch;  // full batches only, as the PyTorch twin
    double loss = 0, seconds = 0;
    for (int epoch = 0; epoch <= epochs; ++epoch) {  // epoch 0: warm-up, not timed
      const auto start = std::chrono::steady_clock::now();
      double total = 0;
      for (std::int64_t s = 0; s < steps; ++s) {
        const ConstView<float> x{train.images.data() + s * batch * 784, Shape{batch, 784}};
        const ConstView<std::int32_t> y{train.labels.data() + s * batch, Shape{batch}};
        total += pipe.train_step(x, y, adamw).loss;
      }
      if (epoch > 0) seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      loss = total / double(steps);
    }
    std::printf("{\"impl\": \"cupipe\", \"threads\": %d, \"samples_per_second\": %.1f, \"loss\": %.5f, \"steps\": %lld}\n",
                threads, double(steps * batch * epochs) / seconds, loss, (long long)(steps * epochs));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mlp_cpu_job: %s\n", e.what());
    return 1;
  }
}
