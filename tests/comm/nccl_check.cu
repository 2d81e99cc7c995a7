// SPDX-License-Identifier: Apache-2.0
// NcclCommunicator between device ranks, under mpirun (one GPU per rank, rank r on device r % count):
//   --stages 2: stage 0 sends three activations to stage 1, stage 1 sends three gradients back; both
//               check every value and the header order; sends complete within the timeout;
//   --stages 1: two data-parallel replicas sum device gradients, host counts and scalars.
//   --pipeline: a Pipeline of backend::Cuda<float> over the NcclCommunicator (--stages 2: 1F1B over
//               two ranks; --stages 1: two data-parallel replicas, whose train_step starts each
//               stage's gradient sum inside the step) against one process running the whole batch on
//               the host backend: the loss and the gradients of one forward/backward, then the
//               weights after 3 SGD steps, within fp32 rounding. With --zero the replicas shard the
//               momentum (ZeRO-1: NCCL reduce-scatter and all-gather) and hold half of it each; with
//               --zero=2 the gradients too, reduce-scattered on the collective stream inside the step;
//               --zero=3 the weights too, gathered through host memory before the stage's actions; with
//               --tensor 2 the two ranks split the MLP Megatron's way (column- then row-parallel,
//               summed over NCCL's tensor group) against the unsplit MLP on the host.
//   --experts:  one stage, an expert-parallel group of the two ranks (comm/nccl_groups.hpp): an
//               all-to-all of uneven blocks (one empty, offsets above 0) checked value by value,
//               host memory refused with its message, and two in flight at once (the group's and
//               the overlapped F's, paired_expert_group); then a mixture-of-experts layer of 4
//               experts split over the two (backend::Cuda<float>, rows moved by NCCL in device
//               memory) against the host's whole layer on each rank's rows: output, input gradient,
//               the router's gradient and each expert's summed over both ranks' rows.
//   --context:  one stage, a context-parallel ring of the two ranks (NcclRing, comm/nccl_groups.hpp): a
//               pass of values that name their sender, host memory refused with its message; then
//               ring attention on backend::Cuda<float> (backend/cuda/ops_ring.cuh) over the ring,
//               each rank's rows of two sequences against the host's attention on the whole ones;
//               then a GPT's Pipeline on the two ranks' chunks of each sequence against one process
//               on the host with whole sequences: losses, gradient norms and weights over 3 AdamW steps.
// Prints PASS, or "SKIPPED:" when there are fewer GPUs than ranks (ctest reports it as skipped):
// NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected").
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <span>
#include <string>
#include <vector>

#include "cupipe/comm/nccl.hpp"
#include "cupipe/cupipe.cuh"
#include "cupipe/gpt/model.hpp"
#include "local_expert_group.hpp"

namespace {

using cupipe::comm::Flow;
using cupipe::comm::MessageKey;

std::vector<float> pattern(int microbatch, Flow flow, std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = float(microbatch * 1000 + int(i)) * (flow == Flow::activation ? 1.0f : -1.0f);
  return v;
}

struct Device {
  explicit Device(std::size_t n) : count(n) { CUPIPE_CHECK_CUDA(cudaMalloc(&data, n * sizeof(float))); }
  ~Device() { cudaFree(data); }
  void upload(const std::vector<float>& v) {
    CUPIPE_CHECK_CUDA(cudaMemcpy(data, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  std::vector<float> download() const {
    std::vector<float> v(count);
    CUPIPE_CHECK_CUDA(cudaMemcpy(v.data(), data, count * sizeof(float), cudaMemcpyDeviceToHost));
    return v;
  }
  float* data = nullptr;
  std::size_t count;
};

bool point_to_point(cupipe::comm::NcclCommunicator& comm) {
  constexpr std::size_t n = 1000;
  const int stage = comm.topology().stage();
  const auto describe = [] { return std::string("nccl_check message"); };
  bool ok = true;
  Device buffer(n);
  if (stage == 0) {
    for (int j = 0; j < 3; ++j) {
      buffer.upload(pattern(j, Flow::activation, n));
      comm.send(1, MessageKey{Flow::activation, 1, j}, buffer.data, n * sizeof(float), describe);
    }
    for (int j = 0; j < 3; ++j) {
      comm.receive(1, MessageKey{Flow::gradient, 0, j}, buffer.data, n * sizeof(float), 30, describe);
      ok = ok && buffer.download() == pattern(j, Flow::gradient, n);
    }
  } else {
    for (int j = 0; j < 3; ++j) {
      comm.receive(0, MessageKey{Flow::activation, 1, j}, buffer.data, n * sizeof(float), 30, describe);
      ok = ok && buffer.download() == pattern(j, Flow::activation, n);
      buffer.upload(pattern(j, Flow::gradient, n));
      comm.send(0, MessageKey{Flow::gradient, 0, j}, buffer.data, n * sizeof(float), describe);
    }
  }
  comm.complete_sends(30);
  return ok;
}

bool replicas(cupipe::comm::NcclCommunicator& comm) {
  constexpr std::size_t n = 4096;
  const int replica = comm.topology().replica();
  Device grads(n);
  grads.upload(std::vector<float>(n, float(replica + 1)));
  comm.sum_over_replicas(grads.data, n);
  const std::vector<float> summed = grads.download();
  bool ok = summed == std::vector<float>(n, 3.0f);  // 1 + 2
  std::vector<double> counts{double(replica), 10.0};  // host memory goes through a device buffer
  comm.sum_over_replicas(counts.data(), counts.size());
  ok = ok && counts[0] == 1.0 && counts[1] == 20.0;
  ok = ok && comm.sum_over_world(0.5) == 1.0;
  return ok;
}

/// Largest |a - b| / max |b| over the two arrays (1 when their sizes differ).
double relative(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 1;
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - double(b[i])));
    scale = std::max(scale, std::abs(double(b[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

using ExpertsWhole = cupipe::MixtureOfExperts<32, 64, 16, cupipe::moe::Routing{4, 2, 1.25}>;
using ExpertsPart = cupipe::MixtureOfExperts<32, 64, 16, cupipe::moe::Routing{4, 2, 1.25}, 2>;

/// The context-parallel ring: a pass, then ring attention against the host's whole sequences.
bool context(cupipe::comm::NcclCommunicator& comm) {
  using namespace cupipe;
  cp::ContextGroup* ring = comm.context_group();
  if (ring == nullptr || ring->size() != 2 || !ring->device_memory()) return false;
  const int me = ring->rank(), previous = 1 - me;
  std::vector<float> mine(100);
  for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = float(me * 1000) + float(i);
  Device sent(mine.size()), received(mine.size());
  sent.upload(mine);
  ring->start_pass(sent.data, received.data, mine.size() * sizeof(float), nullptr);
  ring->finish_pass();
  const std::vector<float> arrived = received.download();
  bool ok = true;
  for (std::size_t i = 0; i < arrived.size(); ++i) ok = ok && arrived[i] == float(previous * 1000) + float(i);
  try {  // host memory is refused before NCCL sees it (both ranks refuse, so neither waits)
    ring->start_pass(mine.data(), received.data, mine.size() * sizeof(float), nullptr);
    ok = false;
  } catch (const std::exception& e) {
    ok = ok && std::string(e.what()).find("was given host memory") != std::string::npos;
  }
  const bool passed = ok;

  constexpr index_t heads = 2, D = 16, C = heads * D, W = 3 * C, T = 64, n = 2 * T, rows = n / 2;
  Rng rng(23);
  std::vector<double> qkv(std::size_t(n * W)), dout(std::size_t(n * C));
  for (double& v : qkv) v = double(float(rng.uniform(-1.5, 1.5)));
  for (double& v : dout) v = double(float(rng.uniform(-1, 1)));
  backend::Host<double> ref;
  std::vector<double> out(std::size_t(n * C)), lse(std::size_t(n * heads)), dqkv(qkv.size());
  ops::causal_attention_forward(ref, ConstView<double>{qkv.data(), Shape{n, W}}, TensorView<double>{out.data(), Shape{n, C}},
                                TensorView<double>{lse.data(), Shape{n, heads}}, heads, T);
  ops::causal_attention_backward(ref, ConstView<double>{qkv.data(), Shape{n, W}}, ConstView<double>{out.data(), Shape{n, C}},
                                 ConstView<double>{lse.data(), Shape{n, heads}}, ConstView<double>{dout.data(), Shape{n, C}},
                                 TensorView<double>{dqkv.data(), Shape{n, W}}, heads, T);
  const auto floats = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
  backend::Cuda<float> gpu(comm.device());  // the communicator's device: the ring's stream and events are there
  const auto upload = [&](const std::vector<double>& whole, index_t width) {
    const std::vector<float> part = floats(cp::local_rows(std::span<const double>(whole), T, me, 2, width));
    auto buffer = gpu.allocate<float>(index_t(part.size()), MemoryTag::activations);
    gpu.upload(std::span<const float>(part), buffer.data());
    return buffer;
  };
  auto dq = upload(qkv, W), dg = upload(dout, C);
  auto o = gpu.allocate<float>(rows * C, MemoryTag::activations), l = gpu.allocate<float>(rows * heads, MemoryTag::activations);
  auto d = gpu.allocate<float>(rows * W, MemoryTag::activations);
  const auto in = [](const auto& buffer, Shape shape) { return buffer.view(shape); };  // a const view
  ops::ring_attention_forward(gpu, *ring, in(dq, Shape{rows, W}), o.view(Shape{rows, C}), l.view(Shape{rows, heads}), heads, T);
  ops::ring_attention_backward(gpu, *ring, in(dq, Shape{rows, W}), in(o, Shape{rows, C}), in(l, Shape{rows, heads}),
                               in(dg, Shape{rows, C}), d.view(Shape{rows, W}), heads, T);
  const auto error = [&](auto& buffer, const std::vector<double>& whole, index_t width) {
    std::vector<float> got(std::size_t(buffer.size()));
    gpu.download(buffer.data(), std::span<float>(got));
    return relative(got, floats(cp::local_rows(std::span<const double>(whole), T, me, 2, width)));
  };
  const double eo = error(o, out, C), el = error(l, lse, heads), ed = error(d, dqkv, W);
  ok = ok && eo <= 1e-5 && el <= 1e-5 && ed <= 1e-5;
  std::printf("rank %d: NCCL context-parallel ring of 2: a pass %s; ring attention against the host's whole sequences: "
              "output %.3g, lse %.3g, dqkv %.3g (relative)\n",
              me, passed ? "equal" : "DIFFERENT", eo, el, ed);
  // Both ranks go on to the pipeline, or neither (one alone would wait out its timeouts).
  int all = ok ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

/// A GPT on one stage whose ring of 2 holds each sequence's zigzag chunks (Pipeline on
/// backend::Cuda<float> over the NCCL ring) against one process on the host with whole sequences:
/// the loss and gradient norm of each of 3 AdamW steps, then the weights, within fp32 rounding.
/// A template: nvcc's host pass loses a gpt::Config template argument used in a plain function.
template <cupipe::gpt::Config config>
bool context_pipeline(std::shared_ptr<cupipe::comm::NcclCommunicator> comm) {
  using namespace cupipe;
  using Gpt = gpt::Model<config>;
  constexpr index_t T = config.context, sequences = 4;
  const comm::Topology& topo = comm->topology();
  Rng rng(8);
  std::vector<std::int32_t> ids(std::size_t(sequences * T)), next(ids.size());
  for (auto& v : ids) v = std::int32_t(rng.below(std::uint64_t(config.vocab)));
  for (auto& v : next) v = std::int32_t(rng.below(std::uint64_t(config.vocab)));
  const auto mine = [&](const std::vector<std::int32_t>& whole) {
    return cp::local_rows(std::span<const std::int32_t>(whole), T, topo.context_rank(), topo.context);
  };
  const std::vector<std::int32_t> my_ids = mine(ids), my_next = mine(next);
  const index_t n = index_t(my_ids.size());
  Pipeline<partition<Gpt, 1>, schedule::OneFOneB, backend::Cuda<float>> distributed(
      {.microbatches = 2, .seed = 4, .devices = {comm->device()}, .transfer_timeout_seconds = 30, .communicator = comm});
  Pipeline<partition<Gpt, 1>, schedule::OneFOneB, backend::Host<float>> reference({.microbatches = 2, .seed = 4});
  const optim::AdamW adamw({.lr = 1e-2, .weight_decay = 0.1, .clip_norm = 0.5});
  bool ok = relative(distributed.parameters(), reference.parameters()) == 0;
  for (int s = 0; s < 3; ++s) {
    const StepStats got = distributed.train_step(ConstView<std::int32_t>{my_ids.data(), Shape{n, 1}},
                                                 ConstView<std::int32_t>{my_next.data(), Shape{n}}, adamw);
    const StepStats want = reference.train_step(ConstView<std::int32_t>{ids.data(), Shape{sequences * T, 1}},
                                                ConstView<std::int32_t>{next.data(), Shape{sequences * T}}, adamw);
    const bool same = std::abs(got.loss - want.loss) <= 1e-5 * want.loss &&
                      std::abs(got.grad_norm - want.grad_norm) <= 1e-4 * want.grad_norm;
    if (topo.rank == 0)
      std::printf("context parallel over NCCL, step %d: loss %.7g, gradient norm %.7g (host, whole sequences: %.7g, %.7g): %s\n",
                  s, got.loss, got.grad_norm, want.loss, want.grad_norm, same ? "equal" : "DIFFERENT");
    ok = ok && same;
  }
  const double w = relative(distributed.parameters(), reference.parameters());
  if (topo.rank == 0) std::printf("context parallel over NCCL: weights after 3 AdamW steps %.3g relative\n", w);
  return ok && w <= 1e-5;
}

/// The expert-parallel group: an all-to-all of uneven blocks, then a mixture-of-experts layer.
bool experts(cupipe::comm::NcclCommunicator& comm) {
  using namespace cupipe;
  moe::ExpertGroup* group = comm.expert_group();
  if (group == nullptr || group->size() != 2 || !group->device_memory()) return false;
  const int me = group->rank();
  // Rank r sends (r + 1)(q + 1) values to rank q, but rank 1 none to rank 0: blocks at offsets
  // above 0 on both ranks, one empty; each value names r, q and i.
  const auto value = [](int r, int q, std::int64_t i) { return float(r * 1000 + q * 100) + float(i); };
  const auto count = [](int r, int q) { return r == 1 && q == 0 ? std::int64_t(0) : std::int64_t(r + 1) * (q + 1); };
  std::vector<std::int64_t> send_counts(2), receive_counts(2);
  std::vector<float> out;
  for (int q = 0; q < 2; ++q) {
    send_counts[std::size_t(q)] = count(me, q);
    receive_counts[std::size_t(q)] = count(q, me);
    for (std::int64_t i = 0; i < send_counts[std::size_t(q)]; ++i) out.push_back(value(me, q, i));
  }
  std::vector<std::int64_t> counts_back(2);
  group->exchange_counts(send_counts.data(), counts_back.data(), 1);
  bool ok = counts_back == receive_counts;
  Device sent(std::max<std::size_t>(out.size(), 1)), received(std::size_t(receive_counts[0] + receive_counts[1]) + 1);
  if (!out.empty()) sent.upload(out);
  group->start_all_to_all(sent.data, send_counts.data(), received.data, receive_counts.data());
  group->finish_all_to_all();
  try {  // host memory is refused before NCCL sees it (every rank refuses, so none waits)
    group->start_all_to_all(out.data(), send_counts.data(), received.data, receive_counts.data());
    ok = false;
  } catch (const std::exception& e) {
    ok = ok && std::string(e.what()).find("was given host memory") != std::string::npos;
  }
  const std::vector<float> in = received.download();
  std::size_t at = 0;
  for (int q = 0; q < 2; ++q)
    for (std::int64_t i = 0; i < receive_counts[std::size_t(q)]; ++i) ok = ok && in[at++] == value(q, me, i);
  // The overlapped F's group (paired_expert_group): its own communicator, so both groups can have an
  // all-to-all in flight at once, as a DualPipeV pair taking turns has them (started in the same
  // order on both ranks, finished in the other order).
  moe::ExpertGroup* paired = comm.paired_expert_group();
  ok = ok && paired != nullptr && paired != group && paired->size() == 2 && paired->rank() == me && paired->device_memory();
  if (paired != nullptr) {
    std::vector<float> twice(out);
    for (float& v : twice) v = -v;
    Device sent2(std::max<std::size_t>(twice.size(), 1)), received2(std::size_t(receive_counts[0] + receive_counts[1]) + 1);
    if (!twice.empty()) sent2.upload(twice);
    group->start_all_to_all(sent.data, send_counts.data(), received.data, receive_counts.data());
    paired->start_all_to_all(sent2.data, send_counts.data(), received2.data, receive_counts.data());
    paired->finish_all_to_all();
    group->finish_all_to_all();
    const std::vector<float> in1 = received.download(), in2 = received2.download();
    at = 0;
    for (int q = 0; q < 2; ++q)
      for (std::int64_t i = 0; i < receive_counts[std::size_t(q)]; ++i, ++at)
        ok = ok && in1[at] == value(q, me, i) && in2[at] == -value(q, me, i);
  }
  const bool moved = ok;

  // The layer: each rank routes its own two sequences; rank t holds experts 2t, 2t + 1.
  constexpr index_t C = 32, T = 16, n = 2 * T;
  using Whole = ExpertsWhole;
  using Part = ExpertsPart;
  const testing::ExpertReference<Whole, float> ref(C, n, 17);  // every rank computes both ranks' references
  const Shape rows{n, C};
  const std::size_t t = std::size_t(me);
  backend::Cuda<float> gpu(comm.device());
  moe::Tally tally;
  gpu.moe_tally = &tally;
  gpu.expert_group = group;
  const std::vector<float> part = testing::expert_part<Whole, Part>(ref.p, C, me);
  const index_t per_row = Part::saved_per_row(C);
  auto upload = [&](const std::vector<float>& v) {
    auto b = gpu.allocate<float>(index_t(v.size()), MemoryTag::workspace);
    gpu.upload(std::span<const float>(v), b.data());
    return b;
  };
  auto dp = upload(part), dx_in = upload(ref.x[t]), ddy = upload(ref.dy[t]), dg = upload(std::vector<float>(part.size(), 0.0f));
  auto y = gpu.allocate<float>(n * C, MemoryTag::workspace), dx = gpu.allocate<float>(n * C, MemoryTag::workspace);
  auto saved = gpu.allocate<float>(n * per_row, MemoryTag::workspace);
  const ConstViewOn<backend::Cuda<float>, float> xv{dx_in.data(), rows}, dyv{ddy.data(), rows};
  const ViewOn<backend::Cuda<float>, float> sv{saved.data(), Shape{n, per_row}};
  Part::forward(gpu, dp.data(), xv, ViewOn<backend::Cuda<float>, float>{y.data(), rows}, sv);
  Part::backward_input(gpu, dp.data(), xv, sv, dyv, ViewOn<backend::Cuda<float>, float>{dx.data(), rows});
  Part::backward_weight(gpu, xv, sv, dyv, dg.data());
  const auto download = [&](const float* d, std::size_t count) {
    std::vector<float> v(count);
    gpu.download(d, std::span<float>(v));
    return v;
  };
  const std::vector<float> g = download(dg.data(), part.size()), expert_sums = testing::expert_part<Whole, Part>(ref.summed, C, me);
  const std::size_t router = std::size_t(Whole::E * C);
  const double ey = relative(download(y.data(), std::size_t(n * C)), ref.y[t]);
  const double edx = relative(download(dx.data(), std::size_t(n * C)), ref.dx[t]);
  const double erouter = relative(std::vector<float>(g.begin(), g.begin() + std::ptrdiff_t(router)),
                                  std::vector<float>(ref.g[t].begin(), ref.g[t].begin() + std::ptrdiff_t(router)));
  const double eexperts = relative(std::vector<float>(g.begin() + std::ptrdiff_t(router), g.end()),
                                   std::vector<float>(expert_sums.begin() + std::ptrdiff_t(router), expert_sums.end()));
  ok = ok && tally.all_to_alls == 4 && ey <= 1e-5 && edx <= 1e-5 && erouter <= 1e-5 && eexperts <= 1e-5;
  std::printf("rank %d: NCCL expert group of 2: all-to-all of uneven blocks %s; a mixture of experts split over it "
              "against the host's whole layer: output %.3g, dx %.3g, router gradient %.3g, experts' gradients %.3g "
              "relative, %lld of %lld choices dropped, %lld all-to-alls\n",
              me, moved ? "equal" : "DIFFERENT", ey, edx, erouter, eexperts,
              static_cast<long long>(tally.dropped), static_cast<long long>(tally.routed),
              static_cast<long long>(tally.all_to_alls));
  return ok;
}

bool pipeline(std::shared_ptr<cupipe::comm::NcclCommunicator> comm, int zero) {
  using namespace cupipe;
  using Model = Sequential<Linear<12, 16>, ReLU, Linear<16, 16>, ReLU, Linear<16, 5>, SoftmaxCrossEntropy<5>>;
  // The same MLP's middle split over two tensor-parallel ranks.
  using Split = Sequential<Linear<12, 16>, ReLU, ColumnParallelLinear<16, 16, 2>, ReLU, RowParallelLinear<16, 5, 2>,
                           SoftmaxCrossEntropy<5>>;
  using Stages = partition<Model, 2>;
  const comm::Topology& topo = comm->topology();
  constexpr index_t batch = 16;
  const index_t share = batch / topo.replicas;
  Rng rng(5);
  std::vector<float> x(static_cast<std::size_t>(batch * 12));
  std::vector<std::int32_t> y(static_cast<std::size_t>(batch));
  for (float& v : x) v = float(rng.normal());
  for (auto& v : y) v = std::int32_t(rng.below(5));
  const ConstView<float> mine{x.data() + topo.replica() * share * 12, Shape{share, 12}};
  const ConstView<std::int32_t> mine_y{y.data() + topo.replica() * share, Shape{share}};
  const ConstView<float> all{x.data(), Shape{batch, 12}};
  const ConstView<std::int32_t> all_y{y.data(), Shape{batch}};

  // One stage per rank (or the whole model per replica): a two-stage partition run by 2 stages, or
  // a one-stage partition of the same model per replica.
  auto run = [&](auto& distributed) {
    Pipeline<Stages, schedule::OneFOneB, backend::Host<float>> reference({.microbatches = 4, .seed = 3});
    const optim::SGD sgd({.lr = 0.1, .momentum = 0.9});
    // A split model starts exactly where the whole model does (each rank draws its part).
    bool ok = relative(distributed.parameters(), reference.parameters()) == 0;
    const StepStats got = distributed.forward_backward(mine, mine_y);
    const StepStats want = reference.forward_backward(all, all_y);
    const double g = relative(distributed.gradients(), reference.gradients());
    const double l = std::abs(got.loss - want.loss) / std::abs(want.loss);
    distributed.step(sgd);
    reference.step(sgd);
    StepStats last;
    for (int s = 0; s < 3; ++s) {
      last = distributed.train_step(mine, mine_y, sgd);
      reference.train_step(all, all_y, sgd);
    }
    const double w = relative(distributed.parameters(), reference.parameters());
    ok = ok && g <= 1e-5 && l <= 1e-5 && w <= 1e-5;
    // ZeRO-1 keeps this replica's shard of the momentum only: half of it with two replicas.
    const std::size_t slots = distributed.backend(topo.stage()).memory.in_use(MemoryTag::optimizer);
    const std::size_t whole = reference.parameters().size() * sizeof(float);
    if (zero) ok = ok && slots * 2 <= whole + 64 * sizeof(float);
    // ZeRO-2 keeps this replica's shard of the gradients between steps, as well.
    const std::size_t gradients = distributed.backend(topo.stage()).memory.in_use(MemoryTag::gradients);
    if (zero >= 2) ok = ok && gradients * 2 <= whole + 64 * sizeof(float);
    // ZeRO-3 keeps this replica's shard of the weights between steps, and gathers once per step.
    const std::size_t weights = distributed.backend(topo.stage()).memory.in_use(MemoryTag::weights);
    if (zero >= 3) ok = ok && weights * 2 <= whole + 64 * sizeof(float) && last.parameter_gathers == 1;
    // Data parallelism without ZeRO-1 starts the stage's sum (ZeRO-2: its reduce-scatter) inside the
    // step (one stage per rank).
    ok = ok && last.overlapped_gradient_sums == (topo.replicas > 1 && zero != 1 ? 1 : 0);
    if (topo.rank == 0)
      std::printf("Pipeline over NCCL (%d stage(s) x %d replica(s) x %d tensor rank(s)%s): loss %.7g (host %.7g), "
                  "gradients %.3g, weights after 3 SGD steps %.3g relative, momentum %zu of %zu bytes, %d gradient "
                  "sum(s) started in the last step: %s\n", topo.stages, topo.replicas, topo.tensor, zero == 3 ? ", ZeRO-3" : zero == 2 ? ", ZeRO-2" : zero ? ", ZeRO-1" : "",
                  got.loss, want.loss, g, w, slots, whole, last.overlapped_gradient_sums, ok ? "equal" : "DIFFERENT");
    return ok;
  };
  // Every stage names this rank's device (only this rank's stage runs here).
  const PipelineOptions options{.microbatches = 4 / topo.replicas, .seed = 3,
                                .devices = std::vector<int>(std::size_t(topo.stages), comm->device()),
                                .transfer_timeout_seconds = 30, .communicator = comm, .zero = zero};
  if (topo.tensor == 2) {
    Pipeline<partition<Split, 1>, schedule::OneFOneB, backend::Cuda<float>> distributed(options);
    return run(distributed);
  }
  if (topo.stages == 2) {
    Pipeline<Stages, schedule::OneFOneB, backend::Cuda<float>> distributed(options);
    return run(distributed);
  }
  Pipeline<partition<Model, 1>, schedule::OneFOneB, backend::Cuda<float>> distributed(options);
  return run(distributed);
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  // Compared with the host backend to fp32 accuracy: exact fp32 GEMMs, not the TF32 default.
  cupipe::backend::cuda::set_default_math(cupipe::backend::cuda::MathMode::fp32);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  int stages = world, tensor = 1;
  bool run_pipeline = false, run_experts = false, run_context = false;
  int zero = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--stages") == 0 && i + 1 < argc) stages = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--tensor") == 0 && i + 1 < argc) tensor = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--pipeline") == 0) run_pipeline = true;
    if (std::strcmp(argv[i], "--experts") == 0) run_experts = true;
    if (std::strcmp(argv[i], "--context") == 0) run_context = true;
    if (std::strcmp(argv[i], "--zero") == 0) zero = 1;
    if (std::strcmp(argv[i], "--zero=2") == 0) zero = 2;
    if (std::strcmp(argv[i], "--zero=3") == 0) zero = 3;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  if (devices < world) {
    if (rank == 0) std::printf("SKIPPED: %d CUDA device(s) for %d ranks\n", devices, world);
    MPI_Finalize();
    return 0;
  }
  int status = 0;
  try {
    auto comm = cupipe::comm::NcclCommunicator::from_mpi(MPI_COMM_WORLD, stages, rank % devices, tensor,
                                                         cupipe::comm::RankOrder::stages_outermost, run_experts ? world : 1,
                                                         run_context ? world : 1);
    const bool ok = run_context    ? context(*comm) && context_pipeline<cupipe::gpt::Config{64, 16, 2, 2, 32}>(comm)
                    : run_experts  ? experts(*comm)
                    : run_pipeline ? pipeline(comm, zero)
                    : stages > 1   ? point_to_point(*comm)
                                   : replicas(*comm);
    int all = ok ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (rank == 0) std::printf("%s\n", all ? "PASS" : "FAIL: values differ");
    status = all ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: FAIL: %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return status;
}
