// SPDX-License-Identifier: Apache-2.0
// The memory estimate against the host allocator's measured peaks, and partition_within<>: a GPT
// whose embedding and head are large next to its blocks, split so that every worker fits a budget
// the FLOP-balanced split exceeds, still trains exactly as the unpipelined Network.
#include "pipeline_test_support.hpp"

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cupipe/core/cpus.hpp"
#include "cupipe/gpt/model.hpp"
#include "cupipe/pipeline/memory_plan.hpp"
#include "cupipe/planner/calibrate.hpp"

namespace {

using namespace cupipe;
using test::Host;

// V 2048 next to C 32: wte and lm_head hold 2 x 65536 of the model's 183 k parameters, and the
// head's output (V per row) is the widest activation.
constexpr gpt::Config config{2048, 16, 4, 2, 32};
using Gpt = gpt::Model<config>;
constexpr index_t T = config.context;
constexpr int sequences_per_microbatch = 2;
constexpr MemoryModel model_of_run{.rows_per_microbatch = sequences_per_microbatch * T, .value_bytes = 8, .optimizer_slots = 2};

struct TokenBatch {
  std::vector<std::int32_t> ids, labels;
  index_t rows = 0;
  TokenBatch(index_t sequences, std::uint64_t salt) : rows(sequences * T) {
    Rng rng(salt);
    for (index_t i = 0; i < rows; ++i) {
      ids.push_back(std::int32_t(rng.below(std::uint64_t(config.vocab))));
      labels.push_back(std::int32_t(rng.below(std::uint64_t(config.vocab))));
    }
  }
  ConstView<std::int32_t> x() const { return {ids.data(), Shape{rows, 1}}; }
  ConstView<std::int32_t> y() const { return {labels.data(), Shape{rows}}; }
};

struct Peaks {
  std::vector<double> total;        ///< per worker, every tag
  std::vector<double> activations;  ///< per worker, the activations tag, in the second step
};

/// Runs two AdamW steps of `Stages` under `Policy` on `B` with M microbatches of two sequences and
/// returns each worker's measured peak bytes in the second step (optimizer slots exist by then).
/// `offload`: the virtual stages that keep at most `resident` records (PipelineOptions::offload).
template <class Stages, class Policy, int M, class B = Host>
Peaks measured(std::vector<int> offload = {}, int resident = 1) {
  PipelineOptions options;
  options.microbatches = M;
  options.seed = 7;
  options.offload = std::move(offload);
  options.offload_resident = resident;
  Pipeline<Stages, Policy, B> pipe(options);
  const optim::AdamW adamw({.lr = 1e-3});
  Peaks peaks;
  for (int step = 0; step < 2; ++step) {
    const TokenBatch batch(M * sequences_per_microbatch, 40 + std::uint64_t(step));
    const StepStats stats = test::bounded(120, [&] { return pipe.train_step(batch.x(), batch.y(), adamw); });
    if (step == 1)
      for (std::int64_t bytes : stats.peak_activation_bytes) peaks.activations.push_back(double(bytes));
  }
  const int workers = int(Stages::size) / Policy::chunks;
  for (int w = 0; w < workers; ++w) peaks.total.push_back(double(pipe.backend(w).memory.peak()));
  return peaks;
}

template <class Stages, class Policy, int M>
std::vector<double> measured_peaks() {
  return measured<Stages, Policy, M>().total;
}

/// A cost model of the GPT on `B` whose times follow its FLOPs (the peaks follow the order of
/// actions, which such times reproduce).
template <class B = Host>
planner::CostModel gpt_cost_model() {
  using Body = Gpt::body;
  LayerProfile profile;
  profile.rows = sequences_per_microbatch * T;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((profile.names.push_back(Body::template describe_layer<I>()),
      profile.forward.push_back(1e-9 * Body::template layer<I>::forward_flops_per_sample(Body::widths[I])),
      profile.backward_input.push_back(I == 0 ? 0.0 : profile.forward.back()),
      profile.backward_weight.push_back(profile.forward.back())),
     ...);
  }(std::make_index_sequence<Body::size>());
  planner::CostModel model = planner::cost_model<Body>(profile, int(sizeof(typename B::value_type)), 2, T);
  model.compute_bytes = int(sizeof(grad_t<B>));
  return model;
}

/// The planner's layout for this run on `B` (gpt_cost_model), split as Stages.
template <class Stages, class Policy, int M, class B = Host>
planner::Layout planned() {
  planner::Request request;
  request.model = gpt_cost_model<B>();
  request.one_process = true;  // the run below: workers of this process (messages land as they are sent)
  request.devices = int(Stages::size) / Policy::chunks;
  request.batch = M * sequences_per_microbatch;
  request.schedules = {std::string(Policy::name)};
  request.stage_counts = {request.devices};
  request.max_microbatches = M;
  request.split = [](int v) { return v == int(Stages::size) ? stage_cuts<Stages>() : std::vector<std::size_t>{}; };
  const planner::Report report = plan(request);
  const auto it = std::find_if(report.ranked.begin(), report.ranked.end(), [](const planner::Layout& l) { return l.microbatches == M; });
  REQUIRE(it != report.ranked.end());
  return *it;
}

template <class Stages, class Policy, int M, class B = Host>
void check_estimate(double tolerance) {
  constexpr auto estimate =
      estimated_stage_bytes<Stages, Policy>(M, memory_model_for<B>(sequences_per_microbatch * T));
  const Peaks peaks = measured<Stages, Policy, M, B>();
  const planner::Layout layout = planned<Stages, Policy, M, B>();
  for (std::size_t w = 0; w < Stages::size; ++w) {
    INFO(Policy::name << " p = " << Stages::size << " worker " << w << ": estimated " << estimate[w] << " bytes, planner "
                      << layout.peak_bytes[w] << " (activations " << layout.peak_activation_bytes[w] << "), measured "
                      << peaks.total[w] << " (activations " << peaks.activations[w] << ")");
    CHECK(std::abs(estimate[w] - peaks.total[w]) <= tolerance * peaks.total[w]);
    // The planner's replay of the allocations in simulated time: activations and the whole.
    CHECK(std::abs(layout.peak_activation_bytes[w] - peaks.activations[w]) <= tolerance * peaks.activations[w]);
    CHECK(std::abs(layout.peak_bytes[w] - peaks.total[w]) <= tolerance * peaks.total[w]);
    // And within the bounds over every timing, exactly: the activations, and the whole under the
    // bound the memory cap is checked against.
    CHECK(peaks.activations[w] >= layout.peak_activation_low_bytes[w]);
    CHECK(peaks.activations[w] <= layout.peak_activation_high_bytes[w]);
    CHECK(peaks.total[w] <= layout.most_bytes[w] * (1 + tolerance));
  }
}

template <std::size_t N>
constexpr double largest(const std::array<double, N>& a) {
  return *std::max_element(a.begin(), a.end());
}

}  // namespace

TEST_CASE("the memory estimate follows each worker's measured peak bytes", "[pipeline][memory]") {
  constexpr double tolerance = 0.05;
  check_estimate<partition<Gpt, 1>, schedule::OneFOneB, 4>(tolerance);
  check_estimate<partition<Gpt, 2>, schedule::GPipe, 4>(tolerance);
  check_estimate<partition<Gpt, 2>, schedule::OneFOneB, 4>(tolerance);
  check_estimate<partition<Gpt, 4>, schedule::OneFOneB, 8>(tolerance);
  check_estimate<partition<Gpt, 4>, schedule::ZeroBubbleH1, 8>(tolerance);
  check_estimate<partition<Gpt, 4>, schedule::ZeroBubbleH2, 8>(tolerance);
}

// Activation offload: GPipe's first worker holds every microbatch's record until its backward; with
// one resident it sends the others to host memory. The measured activation peaks lie within the
// planner's bounds for the same offload plan, and worker 0's is below what any timing gives without.
TEST_CASE("with offload the measured activation peaks lie within the planner's bounds", "[pipeline][memory][offload]") {
  using Stages = partition<Gpt, 2>;
  const planner::CostModel model = gpt_cost_model<Host>();
  const schedule::Plan plan = schedule::generate<schedule::GPipe>(schedule::Config{2, 4});
  const auto sizes = planner::detail::chunk_sizes(model, stage_cuts<Stages>());
  const std::vector<double> rows(4, double(sequences_per_microbatch * T));
  const schedule::OffloadPlan offload = schedule::plan_offload(plan, {0}, 1);
  const planner::detail::ActivationBounds with = planner::detail::activation_bounds(plan, sizes, rows, &offload),
                                          without = planner::detail::activation_bounds(plan, sizes, rows);
  const Peaks peaks = measured<Stages, schedule::GPipe, 4>({0}, 1);
  constexpr double value_bytes = sizeof(double);
  for (std::size_t w = 0; w < 2; ++w) {
    INFO("worker " << w << ": measured " << peaks.activations[w] << " bytes, planner with offload "
                   << with.low[w] * value_bytes << " to " << with.high[w] * value_bytes);
    CHECK(peaks.activations[w] >= with.low[w] * value_bytes);
    CHECK(peaks.activations[w] <= with.high[w] * value_bytes);
  }
  CHECK(with.high[0] < without.low[0]);
}

// bf16 storage: weights in use and activations take 2 bytes, gradients, AdamW slots and the fp32
// master copy 4 (memory_model_for<Host<bfloat16, float>>). The record's statistics (LayerNorm's
// mean and rstd, attention's log-sum-exp) are fp32 values in two bf16 slots each, as counted.
TEST_CASE("the memory estimate follows the measured peaks with bf16 storage", "[pipeline][memory][bf16]") {
  using Bf16 = backend::Host<cupipe::bfloat16, float>;  // in full: OpenBLAS declares a ::bfloat16 too
  static_assert(memory_model_for<Bf16>(1).value_bytes == 2 && memory_model_for<Bf16>(1).compute_bytes == 4);
  // One parameter: a bf16 copy in use, and fp32 gradient, two AdamW slots and master weight.
  static_assert(memory_model_for<Bf16>(1).state_bytes_per_param(1) == 2 + 4 * 4);
  static_assert(memory_model_for<Host>(1).state_bytes_per_param(1) == 8 * 4);
  constexpr double tolerance = 0.05;
  check_estimate<partition<Gpt, 2>, schedule::OneFOneB, 4, Bf16>(tolerance);
  check_estimate<partition<Gpt, 4>, schedule::ZeroBubbleH1, 8, Bf16>(tolerance);
  // One size for every value misses by more than the tolerance, either way: 4 bytes (the activations
  // counted double) or 2 (the gradients, AdamW slots and master copy counted half, and no master).
  const Peaks peaks = measured<partition<Gpt, 2>, schedule::OneFOneB, 4, Bf16>();
  for (const int bytes : {4, 2}) {
    const auto one_size = estimated_stage_bytes<partition<Gpt, 2>, schedule::OneFOneB>(
        4, MemoryModel{.rows_per_microbatch = sequences_per_microbatch * T, .value_bytes = bytes});
    for (std::size_t w = 0; w < 2; ++w) {
      INFO(bytes << " bytes a value: worker " << w << " estimated " << one_size[w] << ", measured " << peaks.total[w]);
      CHECK(std::abs(one_size[w] - peaks.total[w]) > tolerance * peaks.total[w]);
    }
  }
}

// ZeRO (MemoryModel::zero): each worker's estimate loses exactly the state its stage shards, by
// cupipe::sharded_state_bytes, with nothing else changed.
TEST_CASE("the memory estimate counts the parameter state each ZeRO stage keeps", "[pipeline][memory][zero]") {
  using Stages = partition<Gpt, 2>;
  constexpr MemoryModel plain = memory_model_for<Host>(sequences_per_microbatch * T);
  constexpr auto without = estimated_stage_bytes<Stages, schedule::OneFOneB>(4, plain);
  for (const int stage : {1, 2, 3}) {
    MemoryModel sharded = plain;
    sharded.zero = ZeroSetting{stage, 4, true};
    const auto with = estimated_stage_bytes<Stages, schedule::OneFOneB>(4, sharded);
    for (std::size_t w = 0; w < 2; ++w) {
      const double params = w == 0 ? double(Stages::stage<0>::param_count) : double(Stages::stage<1>::param_count);
      const double saved = sharded_state_bytes(params, params, 8, 8, 2, 1, {}, true).total() -
                           sharded_state_bytes(params, params, 8, 8, 2, 1, sharded.zero, true).total();
      INFO("ZeRO-" << stage << ", worker " << w);
      CHECK(without[w] - with[w] == Approx(saved));
    }
  }
  // AdamW's 2 slots over 4 replicas: ZeRO-1 saves 3/4 of 16 bytes a parameter; ZeRO-2 gives back a
  // quarter of 8 (the shard beside the whole buffer within a step).
  CHECK(sharded_state_bytes(1, 1, 8, 8, 2, 1, {}, true).total() - sharded_state_bytes(1, 1, 8, 8, 2, 1, {1, 4}, true).total() == 12);
  CHECK(sharded_state_bytes(1, 1, 8, 8, 2, 1, {2, 4}, true).total() - sharded_state_bytes(1, 1, 8, 8, 2, 1, {1, 4}, true).total() == 2);
}

TEST_CASE("partition_within keeps every worker under a budget the FLOP-balanced split exceeds", "[pipeline][memory]") {
  constexpr int M = 8;
  using Balanced = partition<Gpt, 4>;
  constexpr auto balanced = estimated_stage_bytes<Balanced, schedule::OneFOneB>(M, model_of_run);
  // 85 % of the balanced split's largest worker: the balanced split does not fit.
  constexpr std::uint64_t budget = std::uint64_t(0.85 * largest(balanced));
  using Within = partition_within<Gpt, schedule::OneFOneB, 4, M, model_of_run, budget>;
  constexpr auto within = estimated_stage_bytes<Within, schedule::OneFOneB>(M, model_of_run);
  static_assert(largest(within) <= double(budget));
  // The first stage (embedding, most microbatches in flight) gives up layers; the slowest stage can
  // only get slower under a constraint.
  static_assert(Within::stage<0>::size < Balanced::stage<0>::size);
  static_assert(largest(Within::stage_flops) >= largest(Balanced::stage_flops));
  INFO("budget " << budget << " bytes; balanced split's largest worker " << largest(balanced));

  // Measured: every worker's peak stays within the budget (the estimate's tolerance above).
  const std::vector<double> peaks = measured_peaks<Within, schedule::OneFOneB, M>();
  for (double peak : peaks) CHECK(peak <= 1.05 * double(budget));

  // And it is an ordinary StageList: 1F1B on it equals the Network.
  PipelineOptions options;
  options.microbatches = M;
  options.seed = 3;
  Pipeline<Within, schedule::OneFOneB, Host> pipe(options);
  Network<Gpt, Host> net(3);
  const TokenBatch batch(M * sequences_per_microbatch, 9);
  const StepStats stats = test::bounded(120, [&] { return pipe.forward_backward(batch.x(), batch.y()); });
  const double loss = net.forward_backward(batch.x(), batch.y());
  CHECK(std::abs(stats.loss - loss) <= 1e-12 * std::abs(loss));
  CHECK(test::relative_difference(pipe.gradients(), net.gradients()) <= 1e-12);
}

TEST_CASE("partition_within with room to spare is the FLOP-balanced partition", "[pipeline][memory]") {
  using Balanced = partition<Gpt, 4>;
  using Roomy = partition_within<Gpt, schedule::GPipe, 4, 4, model_of_run, std::uint64_t(1) << 40>;
  static_assert(Roomy::size == Balanced::size);
  constexpr double a = largest(Roomy::stage_flops), b = largest(Balanced::stage_flops);
  static_assert(a <= b * (1 + 1e-12) && b <= a * (1 + 1e-12));
}

TEST_CASE("calibrate_tensor_parts: one rank's part of the GPT, and the sums each layer runs", "[planner]") {
  using Host = backend::Host<float>;
  constexpr gpt::Config c = gpt::tiny;
  using Whole = gpt::Model<c>;
  using Split = gpt::TensorParallelModel<c, 2>;
  Rng rng(4);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(2 * c.context));
  for (auto& t : ids) t = std::int32_t(rng.below(std::uint64_t(c.vocab)));
  const ConstView<std::int32_t> x{ids.data(), Shape{index_t(ids.size()), 1}};
  const planner::TensorVariant part = planner::calibrate_tensor_parts<Split, Host>(x, 2, 1, c.context);
  using Body = Whole::body;
  REQUIRE(part.degree == 2);
  REQUIRE(part.layers.size() == Body::size);
  const std::size_t last = Body::size - 1;  // lm_head (tied to wte)
  for (std::size_t l = 0; l < Body::size; ++l) {
    INFO("layer " << l << ": " << part.layers[l].name);
    const double whole_params = double(Body::param_offsets[l + 1] - Body::param_offsets[l]);
    const bool block = l >= 1 && l + 2 <= last;  // an attention or MLP half
    if (l == 0) {
      // wte split by vocabulary rows (wpe whole); the embedding sums its parts' rows.
      CHECK(part.layers[l].params == Approx(double(c.vocab / 2 * c.channels + c.context * c.channels)));
      CHECK(part.layers[l].sum_forward == c.channels);
      CHECK(part.layers[l].sum_forward_calls == 1);
    } else if (block) {
      // Row-parallel output: one sum of C per row forward; column-parallel input: one backward.
      CHECK(part.layers[l].params < whole_params);
      CHECK(part.layers[l].sum_forward == c.channels);
      CHECK(part.layers[l].sum_backward == c.channels);
      CHECK(part.layers[l].sum_forward_calls == 1);
      CHECK(part.layers[l].sum_backward_calls == 1);
    } else if (l == last) {
      // Column-parallel lm_head: its input gradient sums C per row. The vocabulary-parallel loss,
      // timed with it, gathers 3 statistics per rank and row (a sum over a zeroed table of 3 x 2)
      // in its forward and again in its backward.
      CHECK(part.layers[l].params == Approx(whole_params / 2));
      CHECK(part.layers[l].sum_forward == 3 * 2);
      CHECK(part.layers[l].sum_backward == c.channels + 3 * 2);
      CHECK(part.layers[l].sum_backward_calls == 2);
    } else {
      CHECK(part.layers[l].params == Approx(whole_params));  // ln_f, whole on every rank
      CHECK(part.layers[l].sum_forward == 0);
      CHECK(part.layers[l].sum_backward == 0);
    }
    CHECK(part.layers[l].forward > 0);
  }
}

TEST_CASE("calibrate: the cost model counts the attention's ring values, layer by layer", "[planner][cp]") {
  constexpr gpt::Config small{64, 16, 3, 2, 16};
  using Body = gpt::Model<small>::body;
  const std::size_t n = Body::size;
  LayerProfile profile{std::vector<std::string>(n, "layer"), std::vector<double>(n, 1e-3), std::vector<double>(n, 1e-3),
                       std::vector<double>(n, 1e-3), 16};
  const planner::CostModel model = planner::cost_model<Body>(profile, 4, 2, small.context);
  double total = 0;
  std::size_t carrying = 0;
  for (const planner::LayerCost& l : model.layers) {
    total += l.ring_values;
    carrying += l.ring_values > 0;
  }
  // Each of the 3 blocks passes its keys and values (2C a row); the embedding, head and loss nothing.
  CHECK(total == 3 * 2 * 16);
  CHECK(carrying >= 1);
  CHECK(model.layers.front().ring_values == 0);
  CHECK(model.layers.back().ring_values == 0);
}

TEST_CASE("calibrate: a mixture of experts' all-to-all values, and its sizes as one rank of an expert group",
          "[planner][experts]") {
  constexpr gpt::Config c = [] {
    gpt::Config x{64, 16, 2, 2, 16};
    x.experts = 4;
    x.top_k = 2;
    x.moe_every = 2;  // block 1's MLP
    return x;
  }();
  using Body = gpt::Model<c>::body;
  using Rank = gpt::ExpertParallelModel<c, 2>::body;
  const std::size_t n = Body::size;
  LayerProfile profile{std::vector<std::string>(n, "layer"), std::vector<double>(n, 1e-3), std::vector<double>(n, 1e-3),
                       std::vector<double>(n, 1e-3), 16};
  const planner::CostModel whole = planner::cost_model<Body>(profile, 4, 2, c.context);
  const planner::CostModel rank = planner::sized_as<Rank>(whole);
  std::size_t moe = n;
  for (std::size_t l = 0; l < n; ++l)
    if (whole.layers[l].all_to_all_values > 0) {
      CHECK(moe == n);  // one layer
      moe = l;
    }
  REQUIRE(moe < n);
  CHECK(whole.layers[moe].all_to_all_values == 2 * 16);  // top-2 copies of C values a token
  for (std::size_t l = 0; l < n; ++l) {
    CHECK(rank.layers[l].forward == whole.layers[l].forward);  // the times stay the whole model's
    CHECK(rank.layers[l].all_to_all_values == whole.layers[l].all_to_all_values);
    CHECK(rank.layers[l].params == double(Rank::param_offsets[l + 1] - Rank::param_offsets[l]));
    if (l != moe) CHECK(rank.layers[l].params == whole.layers[l].params);
  }
  // Half the experts: the router stays whole, each expert's weights and biases are halved in number.
  const double expert = 2 * 16 * 64 + 64 + 16;  // one expert: C x 4C, 4C, 4C x C, C
  CHECK(whole.layers[moe].params - rank.layers[moe].params == Approx(2 * expert));
  CHECK_THROWS_WITH(planner::sized_as<gpt::Model<gpt::tiny>::body>(whole), Catch::Contains("sized_as"));
}

TEST_CASE("profile_layers times a first layer's backward_input where its weight gradient needs it", "[planner]") {
  using Host = backend::Host<float>;
  std::vector<float> x(64 * 5, 0.5f);
  const ConstView<float> xv{x.data(), Shape{64, 5}};
  // LinearGELU's weight gradient reads the GELU gradient its backward_input writes: Sequential runs
  // that B even first in a stage, so the profile times it; a first Linear's B never runs.
  const LayerProfile fused = profile_layers<LayerSeq<0, 5, LinearGELU<5, 64>, Linear<64, 3>>, Host>(xv, 3);
  const LayerProfile plain = profile_layers<LayerSeq<0, 5, Linear<5, 64>, Linear<64, 3>>, Host>(xv, 3);
  CHECK(fused.backward_input[0] > 0);
  CHECK(plain.backward_input[0] == 0);
  CHECK(fused.backward_input[1] > 0);
}

namespace {
/// An identity with one parameter that logs each of its actions ("F1", "B1", "W1") into `log`.
inline std::vector<std::string> action_log;
template <int Id>
struct LogHooks {
  static void forward(const auto&) { action_log.push_back("F" + std::to_string(Id)); }
  static void backward_input(const auto&) { action_log.push_back("B" + std::to_string(Id)); }
  static void backward_weight(const auto&) { action_log.push_back("W" + std::to_string(Id)); }
};
template <int Id>
struct Logged : test::IdentityWithWeight<LogHooks<Id>> {
  static std::string describe() { return "Logged<" + std::to_string(Id) + ">"; }
};
}  // namespace

TEST_CASE("profile_layers runs each repeat in step order: every forward, then the gradients from the last layer", "[planner]") {
  using Host = backend::Host<float>;
  std::vector<float> x(8 * 4, 0.5f);
  action_log.clear();
  // Sequential runs one initial forward to fill the record, then the timed runs.
  const LayerProfile profile = profile_layers<LayerSeq<0, 4, Logged<0>, Logged<1>, Logged<2>>, Host>(ConstView<float>{x.data(), Shape{8, 4}}, 2);
  const std::vector<std::string> run{"F0", "F1", "F2", "B2", "W2", "B1", "W1", "W0"};
  std::vector<std::string> expected{"F0", "F1", "F2"};
  for (int r = 0; r < 2; ++r) expected.insert(expected.end(), run.begin(), run.end());
  CHECK(action_log == expected);
  REQUIRE(profile.forward.size() == 3);
  CHECK(profile.backward_input[0] == 0);  // the first layer's input gradient is never run
  CHECK(profile.names[2] == "Logged<2> (layer 2)");
  // The eviction reads at least the last two cache levels, within its bounds.
  CHECK(cupipe::detail::eviction_bytes() >= (std::size_t(8) << 20));
  CHECK(cupipe::detail::eviction_bytes() <= (std::size_t(64) << 20));
}

namespace {
/// A small float MLP and `rows` rows of inputs for it, to calibrate.
struct SmallMlp {
  using Host = backend::Host<float>;
  using Model = Sequential<Linear<16, 32>, ReLU, Linear<32, 4>>;
  std::vector<float> values;
  explicit SmallMlp(index_t rows) : values(std::size_t(rows * 16)) {
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = float(i % 7) / 7.0f - 0.5f;
  }
  ConstView<float> x() const { return {values.data(), Shape{index_t(values.size() / 16), 16}}; }
};
}  // namespace

TEST_CASE("contention: one factor per worker count, 1 for a worker alone, never below 1", "[planner]") {
  using Host = SmallMlp::Host;
  using Mlp = SmallMlp::Model;
  const SmallMlp data(8);
  const ConstView<float> x = data.x();
  const std::vector<double> f = planner::contention<Mlp, Host>(x, 3, 1);
  REQUIRE(f.size() == 3);
  CHECK(f[0] == 1.0);
  CHECK(f[1] >= 1.0);
  CHECK(f[2] >= 1.0);
  CHECK(std::isfinite(f[2]));
  CHECK(planner::contention<Mlp, Host>(x, 1, 1) == std::vector<double>{1.0});
  CHECK_THROWS_WITH((planner::contention<Mlp, Host>(x, 0, 1)), Catch::Contains("at least 1 worker"));
}

TEST_CASE("contention: threads that stand for a launcher's processes leave the caller's core, a process's workers keep it",
          "[planner]") {
  // On a thread of its own, bound to one CPU as Open MPI binds a rank it starts two or fewer of.
  std::vector<std::vector<int>> spread(2), kept(2);
  std::vector<int> caller;
  std::thread([&] {
    const std::vector<int> cpus = core::cpus::allowed();
    if (cpus.size() < 2 || !core::cpus::pin(pthread_self(), {cpus[0]})) return;
    caller = core::cpus::allowed();
    (void)planner::detail::at_once(2, true, [&](int i) {
      spread[std::size_t(i)] = core::cpus::allowed();
      return 0.0;
    });
    (void)planner::detail::at_once(2, false, [&](int i) {
      kept[std::size_t(i)] = core::cpus::allowed();
      return 0.0;
    });
  }).join();
  if (caller.empty()) {
    WARN("fewer than 2 CPUs allowed to this test, or the OS refused to bind a thread: nothing to check");
    return;
  }
  REQUIRE(caller.size() == 1);
  CHECK(kept[0] == caller);
  CHECK(kept[1] == caller);
  // Each on its own share: disjoint, and together more than the caller's one core.
  REQUIRE(!spread[0].empty());
  REQUIRE(!spread[1].empty());
  for (const int c : spread[0]) CHECK(std::find(spread[1].begin(), spread[1].end(), c) == spread[1].end());
  CHECK((spread[0] != caller || spread[1] != caller));
  // The results come back in the threads' order, and a failure after every thread joined.
  const std::vector<double> order = planner::detail::at_once(3, true, [](int i) { return double(i); });
  CHECK(order == std::vector<double>{0.0, 1.0, 2.0});
  CHECK_THROWS_WITH(planner::detail::at_once(2, false,
                                             [](int i) -> double {
                                               if (i == 1) throw std::runtime_error("thread 1 failed");
                                               return 0.0;
                                             }),
                    Catch::Contains("thread 1 failed"));
}

TEST_CASE("processes_on_this_node reads what the launchers set", "[planner]") {
  const char* names[] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"};
  std::vector<std::optional<std::string>> saved;
  for (const char* name : names) {
    const char* v = std::getenv(name);
    saved.push_back(v ? std::optional<std::string>(v) : std::nullopt);
    ::unsetenv(name);
  }
  CHECK(planner::processes_on_this_node() == 0);
  ::setenv("SLURM_NTASKS_PER_NODE", "4(x2)", 1);
  CHECK(planner::processes_on_this_node() == 4);
  ::setenv("MPI_LOCALNRANKS", "3", 1);
  CHECK(planner::processes_on_this_node() == 3);  // before Slurm's
  ::setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "x", 1);  // not a count: the next launcher's
  CHECK(planner::processes_on_this_node() == 3);
  ::setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
  CHECK(planner::processes_on_this_node() == 2);
  for (std::size_t i = 0; i < saved.size(); ++i) {
    if (saved[i]) ::setenv(names[i], saved[i]->c_str(), 1);
    else ::unsetenv(names[i]);
  }
}

TEST_CASE("calibrate: the largest microbatch of each count up to max_microbatches is profiled", "[planner]") {
  using Host = SmallMlp::Host;
  using Mlp = SmallMlp::Model;
  const SmallMlp data(16);
  const ConstView<float> x = data.x();
  const auto rows_of = [](const planner::CostModel& model) {
    std::vector<double> rows;
    for (const auto& point : model.layers[0].points) rows.push_back(point[0]);
    return rows;
  };
  // The batch, a quarter and a sixteenth of it; then 16 split 2 to 6 ways: 8, 6, 4, 4 and 3 rows
  // (a count of 1 is the batch, one past the samples has no microbatch of its own).
  CHECK(rows_of(planner::detail::profiled_layers<Mlp, Host>(x, 1, 1, nullptr)) == std::vector<double>{1, 4, 16});
  CHECK(rows_of(planner::detail::profiled_layers<Mlp, Host>(x, 1, 1, nullptr, {1, 2, 3, 4, 5, 6, 17})) ==
        std::vector<double>{1, 3, 4, 6, 8, 16});
  CHECK_THROWS_WITH((planner::detail::profiled_layers<Mlp, Host>(x, 1, 1, nullptr, {0})), Catch::Contains("at least 1, got 0"));
  // What the search tries on 1 or 2 stages of 256 samples, up to 16 microbatches: powers of two and
  // 1 to 4 per stage.
  CHECK(planner::planned_microbatch_counts({1, 2}, 256, 16) == std::vector<int>{1, 2, 3, 4, 6, 8, 16});
  CHECK(planner::planned_microbatch_counts({4}, 5, 64) == std::vector<int>{1, 2, 4});
}

TEST_CASE("wake_seconds: a worker blocked in its mailbox wakes some microseconds after a post", "[planner]") {
  // Two threads of one process: a sleeping thread is woken by the scheduler, which takes time on
  // every operating system (tens of microseconds on a lightly loaded Linux VM); a hand-over made on
  // one thread, which the figure excludes, does not wait at all.
  const double wake = planner::wake_seconds<Host>(21);
  CHECK(wake > 0);
  CHECK(wake < 0.05);
  CHECK_THROWS_WITH(planner::wake_seconds<Host>(0), Catch::Contains("at least one round trip"));
}

TEST_CASE("partition_at cuts the model where it is asked to", "[partition]") {
  using Mlp = Sequential<Linear<8, 16>, ReLU, Linear<16, 8>, ReLU, Linear<8, 4>, SoftmaxCrossEntropy<4>>;
  CHECK(stage_cuts<partition_at<Mlp, 4>>() == std::vector<std::size_t>{0, 4, 5});
  CHECK(stage_cuts<partition_at<Mlp, 1, 2, 3>>() == std::vector<std::size_t>{0, 1, 2, 3, 5});
  // The balanced partition's own split, spelled out, is the same stage list.
  STATIC_REQUIRE(std::is_same_v<partition_at<Mlp, 2>, detail::partition_impl<Mlp, 2>::type>);
  // The loss rides on the last stage, after its one layer.
  STATIC_REQUIRE(partition_at<Mlp, 4>::stage<1>::size == 1);
  STATIC_REQUIRE(std::is_same_v<partition_at<Mlp, 4>::loss, SoftmaxCrossEntropy<4>>);
  CHECK(partition_at<Mlp, 4>::stage<1>::describe() == "Linear<8, 4>");
}
