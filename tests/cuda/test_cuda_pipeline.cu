// SPDX-License-Identifier: Apache-2.0
// Pipelines on the CUDA backend against the same pipelines on the host: every schedule with 2, 3
// and 4 stages on one GPU (gradients and weights after SGD steps, fp32, 1e-5 relative), the
// hand-over's buffer reuse under a slow consumer (poison + check, with a control that shows the
// check can fail), device-side step timing, the V schedules and DualPipeV's F&B pairs on two
// streams (ordering, held-back blocks, concurrency), the ReLU NaN and null-input contracts, a
// pipeline of CPU and GPU stages (backend::PerWorker), a bad label reported once after a step's
// actions, activation offload and packed hand-overs, and stages on devices 0,0,1,1 ([multi_gpu]).
//
// Own main: exits 77 (ctest "Skipped") without a device, and with fewer devices than
// --min-devices (the multi_gpu tests are registered with --min-devices 2).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "cuda_test_support.hpp"
#include "cupipe/gpt/model.hpp"

using namespace cupipe;
using namespace cupipe::testing;

namespace {

// 8 Linear layers: enough for 8 virtual stages (Interleaved<2> with p = 4).
using Deep = Sequential<Linear<12, 16>, ReLU, Linear<16, 16>, ReLU, Linear<16, 16>, ReLU, Linear<16, 16>, ReLU,
                        Linear<16, 16>, ReLU, Linear<16, 16>, ReLU, Linear<16, 16>, ReLU, Linear<16, 5>>;
constexpr index_t features = 12;
constexpr index_t classes = 5;
constexpr std::uint64_t seed = 20261121;

struct HostBatch {
  std::vector<float> x;
  std::vector<std::int32_t> labels;
  index_t rows;
  ConstView<float> inputs() const { return {x.data(), Shape{rows, features}}; }
  ConstView<std::int32_t> targets() const { return {labels.data(), Shape{rows}}; }
};

HostBatch make_batch(index_t rows, std::uint64_t batch_seed) {
  Rng rng(batch_seed);
  return {random_floats(rng, rows * features), random_ints(rng, rows, classes), rows};
}

/// The batch in the memory the pipeline reads it from: x on the first virtual stage's context, labels
/// on the last's.
template <class Pipe>
struct DeviceBatch {
  DeviceBatch(Pipe& pipe, const HostBatch& b)
      : x(pipe.backend(Pipe::worker_of(0)), b.x),
        labels(pipe.backend(Pipe::worker_of(Pipe::virtual_stages - 1)), b.labels),  // worker 0 in a V
        rows(b.rows) {}
  DeviceConstView<float> inputs() { return x.cview(Shape{rows, features}); }
  DeviceConstView<std::int32_t> targets() { return labels.cview(Shape{rows}); }
  DeviceArray<float, backend::Cuda<float>> x;
  DeviceArray<std::int32_t, backend::Cuda<float>> labels;
  index_t rows;
};

template <class Policy>
constexpr bool flush = Policy::update == schedule::UpdateRule::flush;

/// One stage list on the GPU(s) `devices` against the host: gradients of one forward_backward
/// (flush schedules) on a batch already on the devices, then the weights after three SGD steps on
/// host arrays that the pipeline stages itself.
template <class Policy, int P>
void check_cuda_equals_host(std::vector<int> devices) {
  using Stages = partition_for<Deep, P, Policy>;
  using Gpu = Pipeline<Stages, Policy, backend::Cuda<float>>;
  using Cpu = Pipeline<Stages, Policy, backend::Host<float>>;
  INFO(Policy::name << " p = " << P);
  PipelineOptions options;
  options.microbatches = 4;
  options.seed = seed;
  if (!flush<Policy>) options.batches = 2;
  const index_t rows = 8 * index_t(options.batches > 0 ? options.batches : 1);
  PipelineOptions gpu_options = options;
  gpu_options.devices = devices;

  const optim::SGD sgd({.lr = 0.1, .momentum = 0.9});
  if constexpr (flush<Policy>) {
    Gpu gpu(gpu_options);
    Cpu cpu(options);
    REQUIRE(relative_error(gpu.parameters(), cpu.parameters()) == 0);
    const HostBatch b = make_batch(rows, 7);
    DeviceBatch<Gpu> d(gpu, b);
    const StepStats on_gpu = gpu.forward_backward(d.inputs(), d.targets());
    const StepStats on_cpu = cpu.forward_backward(b.inputs(), b.targets());
    CHECK(relative_error(gpu.gradients(), cpu.gradients()) <= fp32_tolerance);
    CHECK(std::abs(on_gpu.loss - on_cpu.loss) <= fp32_tolerance * std::abs(on_cpu.loss));
    // Device-side timing: one record per planned action, inside the step, per stage in plan order.
    std::size_t planned = 0;
    for (const auto& actions : gpu.plan().actions) planned += actions.size();
    REQUIRE(on_gpu.actions.size() == planned);
    CHECK(on_gpu.makespan_seconds > 0);
    for (const ActionRecord& r : on_gpu.actions) {
      CHECK(r.start >= 0);
      CHECK(r.end >= r.start);
      CHECK(r.end <= on_gpu.makespan_seconds + on_gpu.actions.front().start + 1e-6);
    }
  }
  Gpu gpu(gpu_options);
  Cpu cpu(options);
  for (int step = 0; step < 3; ++step) {
    const HostBatch b = make_batch(rows, 100 + std::uint64_t(step));
    gpu.train_step(b.inputs(), b.targets(), sgd);
    cpu.train_step(b.inputs(), b.targets(), sgd);
  }
  CHECK(gpu.updates() == cpu.updates());
  CHECK(relative_error(gpu.parameters(), cpu.parameters()) <= fp32_tolerance);

  // Inference from host arrays (staged by the pipeline) and from device arrays, against the host.
  const HostBatch t = make_batch(rows, 999);
  std::vector<float> want(std::size_t(rows * classes)), from_host(want.size());
  cpu.predict(t.inputs(), TensorView<float>{want.data(), Shape{rows, classes}});
  gpu.predict(t.inputs(), TensorView<float>{from_host.data(), Shape{rows, classes}});
  CHECK(relative_error(from_host, want) <= fp32_tolerance);
  DeviceBatch<Gpu> d(gpu, t);
  auto out = poisoned<float>(gpu.backend(Gpu::worker_of(Gpu::virtual_stages - 1)), rows * classes);
  gpu.predict(d.inputs(), out.view(Shape{rows, classes}));
  CHECK(relative_error(out.download(), want) <= fp32_tolerance);
}

template <class Policy>
void check_every_stage_count(const std::vector<int>& device_of_stage) {
  check_cuda_equals_host<Policy, 2>(std::vector<int>(device_of_stage.begin(), device_of_stage.begin() + 2));
  check_cuda_equals_host<Policy, 3>(std::vector<int>(device_of_stage.begin(), device_of_stage.begin() + 3));
  check_cuda_equals_host<Policy, 4>(device_of_stage);
}

/// Spins for `cycles` clock cycles, then writes the sum of `in` (one block) to `out`.
template <class Unused = void>
__global__ void slow_sum_kernel(const float* in, index_t n, float* out, long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
  __shared__ float partial[256];
  float sum = 0;
  for (index_t i = threadIdx.x; i < n; i += blockDim.x) sum += in[i];
  partial[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0;
    for (int t = 0; t < int(blockDim.x); ++t) total += partial[t];
    *out = total;
  }
}

long long cycles_for(double seconds) {
  int khz = 0;
  REQUIRE(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0) == cudaSuccess);
  return static_cast<long long>(seconds * double(khz) * 1e3);
}

}  // namespace

// ---- one GPU -----------------------------------------------------------------------------------

TEST_CASE("GPipe on CUDA equals the host for p = 2, 3, 4", "[gpu][pipeline]") {
  check_every_stage_count<schedule::GPipe>({0, 0, 0, 0});
}
TEST_CASE("1F1B on CUDA equals the host for p = 2, 3, 4", "[gpu][pipeline]") {
  check_every_stage_count<schedule::OneFOneB>({0, 0, 0, 0});
}
TEST_CASE("Interleaved<2> on CUDA equals the host for p = 2, 3, 4", "[gpu][pipeline]") {
  check_every_stage_count<schedule::Interleaved<2>>({0, 0, 0, 0});
}
TEST_CASE("ZB-H1 on CUDA equals the host for p = 2, 3, 4", "[gpu][pipeline]") {
  check_every_stage_count<schedule::ZeroBubbleH1>({0, 0, 0, 0});
}
TEST_CASE("ZB-H2 on CUDA equals the host for p = 2, 3, 4", "[gpu][pipeline]") {
  check_every_stage_count<schedule::ZeroBubbleH2>({0, 0, 0, 0});
}
TEST_CASE("PipeDream on CUDA equals the host for p = 2, 3, 4", "[gpu][pipeline]") {
  check_every_stage_count<schedule::PipeDream>({0, 0, 0, 0});
}
TEST_CASE("PipeDream-2BW on CUDA equals the host for p = 2, 3, 4", "[gpu][pipeline]") {
  check_every_stage_count<schedule::PipeDream2BW>({0, 0, 0, 0});
}

TEST_CASE("ZBV, V-Half, DualPipeV (its F&B pairs on two streams) and breadth-first on CUDA equal the host at p = 2",
          "[gpu][pipeline][overlap]") {
  check_cuda_equals_host<schedule::ZeroBubbleV, 2>({0, 0});
  check_cuda_equals_host<schedule::VHalf, 2>({0, 0});
  check_cuda_equals_host<schedule::DualPipeV, 2>({0, 0});
  check_cuda_equals_host<schedule::BreadthFirst<2>, 2>({0, 0});
}

TEST_CASE("activation offload and packed hand-overs on CUDA", "[gpu][pipeline][offload][hand_over]") {
  using Stages = partition_for<Deep, 2, schedule::GPipe>;
  using Gpu = Pipeline<Stages, schedule::GPipe, backend::Cuda<float>>;
  using Cpu = Pipeline<Stages, schedule::GPipe, backend::Host<float>>;
  PipelineOptions options;
  options.microbatches = 4;
  options.seed = seed;
  PipelineOptions offloading = options;
  offloading.offload = {0};  // GPipe's first stage holds 4 records; with one resident 3 go out and back
  offloading.offload_resident = 1;
  PipelineOptions packed = options;
  packed.hand_over = {Wire::e4m3};
  Gpu plain(options), offloaded(offloading), compressed(packed);
  Cpu host(packed);
  const optim::SGD sgd({.lr = 0.1, .momentum = 0.9});
  for (int step = 0; step < 3; ++step) {
    const HostBatch b = make_batch(8, 300 + std::uint64_t(step));
    const StepStats p = plain.train_step(b.inputs(), b.targets(), sgd);
    const StepStats o = offloaded.train_step(b.inputs(), b.targets(), sgd);
    CHECK(o.loss == p.loss);  // the same kernels on the same values: bitwise
    const StepStats c = compressed.train_step(b.inputs(), b.targets(), sgd);
    const StepStats h = host.train_step(b.inputs(), b.targets(), sgd);
    // 4 activations of 2 x 16 floats forward, 4 gradients back: 128 bytes each at full precision,
    // 8 + 32 as e4m3.
    CHECK(p.sent_bytes == std::vector<std::int64_t>{4 * 128, 4 * 128});
    CHECK(c.sent_bytes == std::vector<std::int64_t>{4 * 40, 4 * 40});
    CHECK(c.sent_bytes == h.sent_bytes);
    // The CUDA pack gives the host's codes for the host's values; the values differ in the last bits
    // (other summation orders), which can move a code by one: 1/16 of a value at most.
    CHECK(std::abs(c.loss - h.loss) <= 1e-3 * std::abs(h.loss));
  }
  CHECK(offloaded.parameters() == plain.parameters());
  CHECK(relative_error(compressed.parameters(), host.parameters()) <= 1e-3);
}

TEST_CASE("an overlap's side stream starts after the main stream's work and holds its released blocks until the join",
          "[gpu][cuda][overlap][memory]") {
  constexpr index_t n = 4096;
  backend::Cuda<float> be(0);
  auto values = be.allocate(n, MemoryTag::activations);
  auto side_sum = be.allocate(1, MemoryTag::workspace);
  auto main_sum = be.allocate(1, MemoryTag::workspace);
  const cudaStream_t main = be.stream();
  const long long spin = cycles_for(0.1);
  // On the main stream: poison, a slow kernel, then ones. The side stream must read the ones.
  ops::poison(be, values.view(Shape{n}));
  slow_sum_kernel<<<1, 256, 0, main>>>(values.data(), n, main_sum.data(), spin);
  ops::fill(be, values.view(Shape{n}), 1.0f);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  const std::size_t calls = be.context().pool().driver_allocations();

  be.overlap_begin();
  CHECK(be.context().overlapping());
  CHECK(be.stream() != main);
  CHECK(be.context().main_stream() == main);
  CHECK_THROWS_WITH(be.overlap_begin(), Catch::Contains("already open"));
  ops::poison(be, side_sum.view(Shape{1}));
  slow_sum_kernel<<<1, 256, 0, be.stream()>>>(values.data(), n, side_sum.data(), spin);  // slow: the join must wait
  REQUIRE(cudaGetLastError() == cudaSuccess);
  const float* side_block = nullptr;
  {
    auto temp = be.allocate(2 * n, MemoryTag::activations);  // a fresh block, released on the side stream
    side_block = temp.data();
    ops::fill(be, temp.view(Shape{2 * n}), 2.0f);
  }
  be.overlap_end();
  CHECK(be.stream() == main);
  {
    auto on_main = be.allocate(2 * n, MemoryTag::activations);
    CHECK(on_main.data() != side_block);  // held back: the side stream may still be writing it
  }
  be.overlap_join();
  CHECK_FALSE(be.context().overlapping());
  // Main-stream work after the join sees the side stream's result (without the join's wait this copy
  // would run while the side kernel still spins, and copy the poison).
  auto joined = be.allocate(1, MemoryTag::workspace);
  ops::copy(be, DeviceConstView<float>(side_sum.view(Shape{1})), joined.view(Shape{1}));
  const std::size_t after_side = be.context().pool().driver_allocations();
  CHECK(after_side >= calls + 2);  // the side stream's block and the main stream's, both fresh
  {
    auto reused = be.allocate(2 * n, MemoryTag::activations);  // now from the cache
    CHECK(be.context().pool().driver_allocations() == after_side);
  }
  be.overlap_join();  // a join without an overlap does nothing
  be.synchronize();
  float got = 0;
  be.download(joined.data(), std::span<float>(&got, 1));
  CHECK(got == float(n));
}

TEST_CASE("an overlap's two streams run at once", "[gpu][cuda][overlap][timing]") {
  backend::Cuda<float> be(0);
  auto a = be.allocate(256, MemoryTag::activations);
  auto sums = be.allocate(2, MemoryTag::workspace);
  ops::fill(be, a.view(Shape{256}), 1.0f);
  be.synchronize();
  const long long spin = cycles_for(0.2);
  // One kernel alone first: the clock may run below its rated speed, so time it rather than assume.
  auto start = std::chrono::steady_clock::now();
  slow_sum_kernel<<<1, 256, 0, be.stream()>>>(a.data(), 256, sums.data(), spin);
  be.synchronize();
  const double alone = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  start = std::chrono::steady_clock::now();
  be.overlap_begin();
  slow_sum_kernel<<<1, 256, 0, be.stream()>>>(a.data(), 256, sums.data(), spin);
  be.overlap_end();
  slow_sum_kernel<<<1, 256, 0, be.stream()>>>(a.data(), 256, sums.data() + 1, spin);
  be.overlap_join();
  be.synchronize();
  const double both = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CAPTURE(alone, both);
  CHECK(both < 1.5 * alone);  // one stream after the other would take 2x
}

namespace {

/// A small tied GPT (V 64, T 16, 2 blocks, 2 heads, C 32) on the GPU against the same pipeline on the
/// host: loss and gradients of one forward_backward, weights after 3 SGD steps, a prediction. With
/// `packed`, packed sequences: token 5 begins a document, 1 to 3 of them in each sequence, and both
/// pipelines take the borders (the GPU attention then runs once per document).
template <class Policy, int P>
void check_gpt_cuda_equals_host(bool packed = false) {
  constexpr gpt::Config config{64, 16, 2, 2, 32};
  using Stages = partition_for<gpt::Model<config>, P, Policy>;
  using Gpu = Pipeline<Stages, Policy, backend::Cuda<float>>;
  using Cpu = Pipeline<Stages, Policy, backend::Host<float>>;
  INFO("GPT " << Policy::name << " p = " << P << (packed ? ", packed" : ""));
  PipelineOptions options;
  options.microbatches = 4;
  options.seed = seed;
  options.packed_sequences = packed;
  Gpu gpu(options);
  Cpu cpu(options);
  REQUIRE(relative_error(gpu.parameters(), cpu.parameters()) == 0);
  Rng rng(31);
  const index_t rows = 6 * config.context;  // 6 sequences: 2, 2, 1, 1 per microbatch
  std::vector<std::int32_t> ids = random_ints(rng, rows, config.vocab);
  const std::vector<std::int32_t> next = random_ints(rng, rows, config.vocab);
  if (packed)
    for (index_t s = 0; s < 6; ++s)
      for (std::uint64_t k = 0, n = 1 + rng.below(3); k < n; ++k) ids[std::size_t(s * config.context) + 1 + rng.below(std::uint64_t(config.context - 1))] = 5;
  const std::vector<std::int32_t> starts = document_starts(ids, config.context, 5);
  const DocumentStarts documents = packed ? DocumentStarts{starts.data(), rows} : DocumentStarts{};
  const ConstView<std::int32_t> x{ids.data(), Shape{rows, 1}}, y{next.data(), Shape{rows}};
  const StepStats on_gpu = gpu.forward_backward(x, y, documents);
  const StepStats on_cpu = cpu.forward_backward(x, y, documents);
  CHECK(std::abs(on_gpu.loss - on_cpu.loss) <= fp32_tolerance * std::abs(on_cpu.loss));
  CHECK(relative_error(gpu.gradients(), cpu.gradients()) <= fp32_tolerance);
  const optim::SGD sgd({.lr = 0.1, .momentum = 0.9, .clip_norm = 1.0});
  gpu.step(sgd);
  cpu.step(sgd);
  for (int step = 0; step < 2; ++step) {
    gpu.train_step(x, y, sgd, documents);
    cpu.train_step(x, y, sgd, documents);
  }
  CHECK(relative_error(gpu.parameters(), cpu.parameters()) <= fp32_tolerance);
  std::vector<float> want(std::size_t(config.context * config.vocab)), got(want.size());
  const ConstView<std::int32_t> one{ids.data(), Shape{config.context, 1}};
  const DocumentStarts first = packed ? DocumentStarts{starts.data(), config.context} : DocumentStarts{};
  cpu.predict(one, TensorView<float>{want.data(), Shape{config.context, config.vocab}}, first);
  gpu.predict(one, TensorView<float>{got.data(), Shape{config.context, config.vocab}}, first);
  CHECK(relative_error(got, want) <= fp32_tolerance);
}

}  // namespace

TEST_CASE("a GPT on CUDA equals the host: 1F1B and ZB-H1 (attention's B and W split) at p = 1, 2",
          "[gpu][pipeline][gpt]") {
  check_gpt_cuda_equals_host<schedule::OneFOneB, 1>();
  check_gpt_cuda_equals_host<schedule::OneFOneB, 2>();
  check_gpt_cuda_equals_host<schedule::ZeroBubbleH1, 2>();
}

TEST_CASE("a GPT on CUDA equals the host with packed sequences (document borders): 1F1B at p = 2",
          "[gpu][pipeline][gpt][documents]") {
  check_gpt_cuda_equals_host<schedule::OneFOneB, 2>(true);
}

TEST_CASE("a hand-over never overwrites a pooled buffer its slow consumer still reads", "[gpu][pipeline][memory]") {
  constexpr index_t n = 4096;
  backend::Cuda<float> producer(0), consumer(0);
  auto ones = producer.allocate(n, MemoryTag::activations);
  ops::fill(producer, ones.view(Shape{n}), 1.0f);
  auto poison_source = producer.allocate(n, MemoryTag::activations);
  ops::poison(producer, poison_source.view(Shape{n}));
  producer.synchronize();
  auto sum = consumer.allocate(1, MemoryTag::workspace);
  const long long spin = cycles_for(0.2);

  // The consumer receives ones, reads them slowly, and gives the buffer back to its pool at once
  // (stream order). The next hand-over gets the same block and writes poison into it.
  const auto run = [&](bool through_transfer) {
    auto received = consumer.allocate(n, MemoryTag::activations);
    ops::transfer(producer, consumer, DeviceConstView<float>(ones.view(Shape{n})), received.view(Shape{n}));
    slow_sum_kernel<<<1, 256, 0, consumer.stream()>>>(received.data(), n, sum.data(), spin);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    const float* block = received.data();
    received = {};
    auto next = consumer.allocate(n, MemoryTag::activations);
    REQUIRE(next.data() == block);  // the pool recycled it, so only the fence protects the reader
    if (through_transfer)
      ops::transfer(producer, consumer, DeviceConstView<float>(poison_source.view(Shape{n})), next.view(Shape{n}));
    else  // control: the same copy without the fence
      REQUIRE(cudaMemcpyAsync(next.data(), poison_source.data(), n * sizeof(float), cudaMemcpyDeviceToDevice,
                              producer.stream()) == cudaSuccess);
    producer.synchronize();
    consumer.synchronize();
    float out = 0;
    consumer.download(sum.data(), std::span<float>(&out, 1));
    return out;
  };
  SECTION("transfer waits for the consumer's last read") { CHECK(run(true) == float(n)); }
  SECTION("control: an unfenced copy overtakes the slow reader, so the check above can fail") {
    CHECK(std::isnan(run(false)));
  }
}

TEST_CASE("a CPU stage and a GPU stage in one pipeline (backend::PerWorker) equal the all-host pipeline",
          "[gpu][pipeline][mixed]") {
  // Host, then GPU, then host again (1F1B, 3 workers), and the GPU first under a V (worker 0 holds
  // the first and the last virtual stage): each hand-over between host and device memory goes
  // through pipeline::hand_over. fp32 on both sides (exact GEMMs), so 1e-5 relative. Then a bf16
  // GPU stage beside an fp32 host one, against the same layout on two host backends (bf16 on the
  // host is the device's oracle): the hand-overs convert as well as copy.
  using Cpu = backend::Host<float>;
  using Gpu = backend::Cuda<float>;
  const auto check = [&]<class Stages, class Policy, class Spec, class Reference = Cpu>(double tolerance = fp32_tolerance) {
    using Mixed = Pipeline<Stages, Policy, Spec>;
    using Plain = Pipeline<Stages, Policy, Reference>;
    static_assert(Mixed::mixed);
    INFO(Policy::name);
    PipelineOptions options;
    options.microbatches = 4;
    options.seed = seed;
    Mixed mixed(options);
    Plain plain(options);
    REQUIRE(relative_error(mixed.parameters(), plain.parameters()) == 0);
    const HostBatch b = make_batch(8, 17);
    const StepStats on_mixed = mixed.forward_backward(b.inputs(), b.targets());
    const StepStats on_plain = plain.forward_backward(b.inputs(), b.targets());
    CHECK(relative_error(mixed.gradients(), plain.gradients()) <= tolerance);
    CHECK(std::abs(on_mixed.loss - on_plain.loss) <= tolerance * std::abs(on_plain.loss));
    const optim::SGD sgd({.lr = 0.1, .momentum = 0.9});
    mixed.step(sgd);
    plain.step(sgd);
    for (int step = 0; step < 2; ++step) {
      const HostBatch next = make_batch(8, 200 + std::uint64_t(step));
      mixed.train_step(next.inputs(), next.targets(), sgd);
      plain.train_step(next.inputs(), next.targets(), sgd);
    }
    CHECK(relative_error(mixed.parameters(), plain.parameters()) <= tolerance);
    const HostBatch t = make_batch(8, 999);
    using PT = typename Plain::T;
    using MT = typename Mixed::T;  // the last stage's storage: bf16 where the GPU stage is
    std::vector<PT> want(std::size_t(8 * classes));
    std::vector<MT> got(want.size());
    plain.predict(t.inputs(), TensorView<PT>{want.data(), Shape{8, classes}});
    mixed.predict(t.inputs(), TensorView<MT>{got.data(), Shape{8, classes}});
    std::vector<float> want_f, got_f;
    for (const PT& v : want) want_f.push_back(float(v));
    for (const MT& v : got) got_f.push_back(float(v));
    CHECK(relative_error(got_f, want_f) <= tolerance);
  };
  check.template operator()<partition<Deep, 3>, schedule::OneFOneB, backend::PerWorker<Cpu, Gpu, Cpu>>();
  check.template operator()<partition_for<Deep, 2, schedule::ZeroBubbleV>, schedule::ZeroBubbleV, backend::PerWorker<Gpu, Cpu>>();
  using GpuBf16 = backend::Cuda<cupipe::bfloat16, float>;  // in full: OpenBLAS declares a ::bfloat16 too
  using CpuBf16 = backend::Host<cupipe::bfloat16, float>;
  check.template operator()<partition<Deep, 2>, schedule::OneFOneB, backend::PerWorker<Cpu, GpuBf16>,
                            backend::PerWorker<Cpu, CpuBf16>>(1e-2);
}

TEST_CASE("a CUDA pipeline step reads its losses once and reports a label out of range after its actions, "
          "committing nothing",
          "[gpu][pipeline][errors]") {
  // During a flush step the loss kernels only record a bad label (no wait after each op); the step
  // then reports it once, before the update, and restores check_inputs. The batch is in device
  // memory: a host batch's labels are checked before the step (pipeline/batch_values.hpp).
  using Pipe = Pipeline<partition<Deep, 2>, schedule::OneFOneB, backend::Cuda<float>>;
  PipelineOptions options;
  options.microbatches = 4;
  options.seed = seed;
  Pipe pipe(options), fresh(options);
  HostBatch b = make_batch(8, 17);
  const std::int32_t good = b.labels[5];
  b.labels[5] = std::int32_t(classes) + 2;  // microbatch 2, its row 1
  const std::vector<float> before = pipe.parameters();
  const optim::SGD sgd({.lr = 0.1});
  std::string message;
  DeviceArray<float, backend::Cuda<float>> device_x(pipe.backend(0), b.x);
  DeviceArray<std::int32_t, backend::Cuda<float>> device_labels(pipe.backend(1), b.labels);
  try {
    (void)pipe.train_step(device_x.cview(Shape{b.rows, features}), device_labels.cview(Shape{b.rows}), sgd);
  } catch (const std::exception& e) {
    message = e.what();
  }
  CHECK_THAT(message, Catch::StartsWith("worker 1, after the step's actions: ") && Catch::Contains("met label 7 at row 1"));
  // The same batch from host memory is refused before the step, by its row in the batch.
  std::string refused;
  try {
    (void)pipe.train_step(b.inputs(), b.targets(), sgd);
  } catch (const std::exception& e) {
    refused = e.what();
  }
  CHECK_THAT(refused, Catch::Contains("label 7 at row 5 of the batch (microbatch 2, its row 1)"));
  CHECK(pipe.parameters() == before);
  CHECK(pipe.backend(1).check_inputs);
  CHECK(pipe.backend(0).check_inputs);
  // Nothing of the failed step remains: the next step is a fresh pipeline's first.
  b.labels[5] = good;
  const StepStats after = pipe.train_step(b.inputs(), b.targets(), sgd);
  CHECK(after.loss == fresh.train_step(b.inputs(), b.targets(), sgd).loss);
  CHECK(pipe.parameters() == fresh.parameters());
}

TEST_CASE("CUDA relu_forward propagates NaN like the host op", "[gpu][cuda][ops]") {
  backend::Cuda<float> be;
  backend::Host<float> host;
  const std::vector<float> x{-1.0f, 0.0f, 2.0f, std::numeric_limits<float>::quiet_NaN(), -0.0f};
  const Shape s{index_t(x.size())};
  DeviceArray<float, backend::Cuda<float>> dx(be, x);
  auto y = poisoned<float>(be, s.numel());
  ops::relu_forward(be, dx.cview(s), y.view(s));
  std::vector<float> ref(x.size());
  ops::relu_forward(host, ConstView<float>{x.data(), s}, TensorView<float>{ref.data(), s});
  const std::vector<float> out = y.download();
  for (std::size_t i = 0; i < x.size(); ++i) {
    INFO("x = " << x[i]);
    CHECK(std::isnan(out[i]) == std::isnan(ref[i]));
    if (!std::isnan(ref[i])) CHECK(out[i] == ref[i]);
  }
  CHECK(std::isnan(out[3]));
}

TEST_CASE("CUDA ops reject a null input view as the host ops do", "[gpu][cuda][ops][errors]") {
  backend::Cuda<float> be;
  const Shape s{4, 3};
  DeviceArray<float, backend::Cuda<float>> y(be, s.numel()), b(be, 3);
  const DeviceConstView<float> null_input{nullptr, s};
  const auto fails = [](auto&& call, const char* text) {
    try {
      call();
      FAIL("no exception for " << text);
    } catch (const cupipe::error& e) {
      CHECK_THAT(e.message(), Catch::Contains(text) && Catch::Contains("null pointer"));
    }
  };
  fails([&] { ops::relu_forward(be, null_input, y.view(s)); }, "relu_forward: x");
  fails([&] { ops::gelu_forward(be, null_input, y.view(s)); }, "gelu_forward: x");
  fails([&] { ops::copy(be, null_input, y.view(s)); }, "copy: source");
  fails([&] { ops::axpy(be, 1.0f, null_input, y.view(s)); }, "axpy: x");
  fails([&] { ops::residual_add(be, null_input, y.cview(s), y.view(s)); }, "residual_add: a");
  fails([&] { ops::bias_backward(be, null_input, b.view(Shape{3})); }, "bias_backward: dy");
  fails([&] { ops::sum_of_squares(be, null_input); }, "sum_of_squares: x");
  fails([&] { ops::transfer(be, be, null_input, y.view(s)); }, "transfer: source");
}

// ---- several GPUs ------------------------------------------------------------------------------

TEST_CASE("1F1B with stages on devices 0,0,1,1 equals the host", "[multi_gpu][pipeline]") {
  check_every_stage_count<schedule::OneFOneB>({0, 0, 1, 1});
}
TEST_CASE("Interleaved<2> with stages on devices 0,0,1,1 equals the host", "[multi_gpu][pipeline]") {
  check_every_stage_count<schedule::Interleaved<2>>({0, 0, 1, 1});
}
TEST_CASE("predict before any step, stages on devices 0 and 1, equals the host", "[multi_gpu][pipeline]") {
  // The activation crosses devices through transfer(): stage 1 never reads stage 0's memory itself.
  using Stages = partition<Deep, 2>;
  PipelineOptions options;
  options.seed = seed;
  options.microbatches = 2;
  PipelineOptions on_gpus = options;
  on_gpus.devices = {0, 1};
  Pipeline<Stages, schedule::OneFOneB, backend::Cuda<float>> gpu(on_gpus);
  Pipeline<Stages, schedule::OneFOneB, backend::Host<float>> cpu(options);
  const HostBatch t = make_batch(8, 4242);
  std::vector<float> want(std::size_t(8 * classes)), got(want.size());
  cpu.predict(t.inputs(), TensorView<float>{want.data(), Shape{8, classes}});
  gpu.predict(t.inputs(), TensorView<float>{got.data(), Shape{8, classes}});
  CHECK(relative_error(got, want) <= fp32_tolerance);
}

TEST_CASE("ZB-H1 and PipeDream-2BW with stages on devices 0,0,1,1 equal the host", "[multi_gpu][pipeline]") {
  check_cuda_equals_host<schedule::ZeroBubbleH1, 4>({0, 0, 1, 1});
  check_cuda_equals_host<schedule::PipeDream2BW, 4>({0, 0, 1, 1});
}

int main(int argc, char* argv[]) {
  Catch::Session session;
  int min_devices = 1;
  session.cli(session.cli() | Catch::clara::Opt(min_devices, "count")["--min-devices"](
                                  "exit 77 (skipped) with fewer CUDA devices than this"));
  if (const int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  const auto& config = session.configData();
  const bool listing = config.listTestNamesOnly || config.listTests || config.listTags || config.listReporters;
  if (!listing) {
    int count = 0;
    const cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess || count < min_devices) {
      std::printf("skipped: %d CUDA device(s) present, %d needed (%s)\n", status == cudaSuccess ? count : 0, min_devices,
                  status != cudaSuccess ? cudaGetErrorString(status) : "too few");
      return 77;
    }
  }
  return session.run();
}
