// SPDX-License-Identifier: Apache-2.0
// Training for real: measured traces and costs after real steps, profiled rebalancing, and the
// trainer-level loop against the unpipelined Network.
#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <regex>
#include <sstream>

#include "cupipe/pipeline/rebalance.hpp"
#include "cupipe/pipeline/trace.hpp"
#include "training_test_support.hpp"

using namespace cupipe;
using namespace cupipe::test;

namespace {

using ZeroBubble4 = Pipeline<partition<Mlp, 4>, schedule::ZeroBubbleH1, backend::Host<float>>;
using GPipe4 = Pipeline<partition<Mlp, 4>, schedule::GPipe, backend::Host<float>>;

std::size_t action_count(const schedule::Plan& plan) {
  std::size_t n = 0;
  for (const auto& per_stage : plan.actions) n += per_stage.size();
  return n;
}

/// "F3" for the plan's action, as the trace names it.
std::string label(schedule::ActionKind kind, int microbatch) {
  return std::string(1, "FBW"[int(kind)]) + std::to_string(microbatch);
}

template <class Pipe>
void check_trace(Pipe& pipe) {
  const optim::AdamW adamw({.lr = 1e-2});
  const auto batch = make_batch<float>(16, 4);
  pipe.train_step(batch.inputs(), batch.targets(), adamw);  // warm-up: first-touch allocations
  const StepStats stats = pipe.train_step(batch.inputs(), batch.targets(), adamw);
  const schedule::Plan& plan = pipe.plan();

  const nlohmann::json trace = nlohmann::json::parse(measured_trace_json(plan, stats));
  REQUIRE(trace.contains("traceEvents"));
  std::map<int, std::string> group_of_pid;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "M" && e["name"] == "process_name") group_of_pid[e["pid"].get<int>()] = e["args"]["name"].get<std::string>();
  REQUIRE(group_of_pid.size() == 2);
  int measured = -1, simulated = -1;
  for (const auto& [pid, name] : group_of_pid) {
    if (name == "measured") measured = pid;
    if (name.starts_with("simulated (predicted")) simulated = pid;
  }
  REQUIRE(measured >= 0);
  REQUIRE(simulated >= 0);

  // Per group and stage (tid), the multiset of action names must be the plan's for that stage.
  std::map<int, std::map<int, std::multiset<std::string>>> names;  // pid -> tid -> names
  std::map<int, std::size_t> count;
  const std::regex action_name("[FBW][0-9]+");
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] != "X") continue;
    const std::string name = e["name"].get<std::string>();
    CHECK(std::regex_match(name, action_name));
    CHECK(e["dur"].get<double>() >= 0);
    names[e["pid"].get<int>()][e["tid"].get<int>()].insert(name);
    ++count[e["pid"].get<int>()];
  }
  CHECK(count[measured] == action_count(plan));
  CHECK(count[simulated] == action_count(plan));
  for (int s = 0; s < Pipe::stages; ++s) {
    std::multiset<std::string> expected;
    for (const schedule::Action& a : plan.actions[std::size_t(s)]) expected.insert(label(a.kind, a.microbatch));
    CHECK(names[measured][s] == expected);
    CHECK(names[simulated][s] == expected);
  }

  // The ASCII chart: one row per stage, in order.
  std::istringstream chart(measured_ascii_timeline(stats, Pipe::stages));
  std::vector<std::string> rows;
  for (std::string line; std::getline(chart, line);)
    if (line.starts_with("worker ")) rows.push_back(line);
  REQUIRE(int(rows.size()) == Pipe::stages);
  for (int s = 0; s < Pipe::stages; ++s) CHECK(rows[std::size_t(s)].starts_with("worker " + std::to_string(s) + "|"));

  // Measured costs: every stage did forward and backward work, and W only where the plan splits it.
  const schedule::Costs costs = measured_costs(stats, Pipe::stages, Pipe::chunks);
  REQUIRE(int(costs.per_stage.size()) == Pipe::stages);
  for (int s = 0; s < Pipe::stages; ++s) {
    INFO("stage " << s);
    CHECK(costs.per_stage[std::size_t(s)].forward > 0);
    CHECK(costs.per_stage[std::size_t(s)].backward > 0);
    if (plan.split_backward) CHECK(costs.per_stage[std::size_t(s)].weight > 0);
    else CHECK(costs.per_stage[std::size_t(s)].weight == 0);
  }
}

}  // namespace

TEST_CASE("the measured trace is valid JSON with one event per planned action, measured and simulated",
          "[cpu][trace]") {
  SECTION("1F1B") {
    OneFOneB4<float> pipe({.microbatches = 4, .seed = 1});
    check_trace(pipe);
  }
  SECTION("GPipe") {
    GPipe4 pipe({.microbatches = 4, .seed = 1});
    check_trace(pipe);
  }
  SECTION("zero bubble H1: W actions too") {
    ZeroBubble4 pipe({.microbatches = 4, .seed = 1});
    check_trace(pipe);
  }
}

// ---- rebalancing ------------------------------------------------------------------------------

namespace {

LayerProfile random_profile(Rng& rng, std::size_t layers) {
  LayerProfile p;
  p.rows = 8;
  for (std::size_t i = 0; i < layers; ++i) {
    p.names.push_back("layer" + std::to_string(i));
    // Costs over two orders of magnitude, so the splits differ a lot.
    p.forward.push_back(std::exp(rng.uniform(-2.0, 2.5)));
    p.backward_input.push_back(i == 0 ? 0.0 : std::exp(rng.uniform(-2.0, 2.5)));
    p.backward_weight.push_back(std::exp(rng.uniform(-2.0, 2.5)));
  }
  return p;
}

std::vector<std::size_t> random_cuts(Rng& rng, std::size_t layers, std::size_t parts) {
  std::vector<std::size_t> cuts{0};
  while (cuts.size() < parts) {
    const std::size_t low = cuts.back() + 1, high = layers - (parts - cuts.size());
    cuts.push_back(low + rng.below(high - low + 1));
  }
  cuts.push_back(layers);
  return cuts;
}

bool valid_split(const std::vector<std::size_t>& cuts, std::size_t layers, std::size_t parts) {
  if (cuts.size() != parts + 1 || cuts.front() != 0 || cuts.back() != layers) return false;
  for (std::size_t k = 0; k + 1 < cuts.size(); ++k)
    if (cuts[k] >= cuts[k + 1]) return false;
  return true;
}

/// The smallest predicted makespan over every contiguous split, by brute force.
double best_makespan(const schedule::Plan& plan, const LayerProfile& profile, std::size_t parts) {
  const std::size_t layers = profile.forward.size();
  double best = 1e300;
  std::vector<std::size_t> cuts(parts + 1, 0);
  cuts[parts] = layers;
  std::function<void(std::size_t)> visit = [&](std::size_t k) {
    if (k == parts) {
      best = std::min(best, detail::predicted_makespan(plan, profile, cuts));
      return;
    }
    for (std::size_t c = cuts[k - 1] + 1; c + (parts - k) <= layers; ++c) {
      cuts[k] = c;
      visit(k + 1);
    }
  };
  visit(1);
  return best;
}

}  // namespace

TEST_CASE("rebalance never predicts worse than the current split and finds the best one", "[cpu][rebalance]") {
  const std::vector<std::pair<std::string, schedule::Plan>> plans{
      {"1f1b", schedule::generate<schedule::OneFOneB>({4, 8})},
      {"gpipe", schedule::generate<schedule::GPipe>({4, 8})},
      {"zb-h1", schedule::generate<schedule::ZeroBubbleH1>({4, 8})},
      {"1f1b on 3 stages", schedule::generate<schedule::OneFOneB>({3, 6})},
      {"interleaved 2x2", schedule::generate<schedule::Interleaved<2>>({2, 4, 2})},
  };
  REQUIRE(plans[2].second.split_backward);
  Rng rng(2024);
  for (const auto& [name, plan] : plans) {
    const std::size_t parts = std::size_t(plan.config.virtual_stages());
    for (int trial = 0; trial < 12; ++trial) {
      const std::size_t layers = parts + rng.below(5);
      const LayerProfile profile = random_profile(rng, layers);
      const std::vector<std::size_t> current = random_cuts(rng, layers, parts);
      const RebalanceProposal p = rebalance(plan, profile, current);
      INFO(name << ", trial " << trial << ":\n" << describe(p));
      CHECK(p.current == current);
      CHECK(valid_split(p.proposed, layers, parts));
      CHECK(p.proposed_makespan <= p.current_makespan);
      CHECK(p.current_makespan == detail::predicted_makespan(plan, profile, current));
      CHECK(p.proposed_makespan == detail::predicted_makespan(plan, profile, p.proposed));
      CHECK(p.proposed_makespan == best_makespan(plan, profile, parts));
    }
  }
}

TEST_CASE("rebalance isolates one very expensive layer", "[cpu][rebalance]") {
  // Eight layers of cost 1 (forward) + 2 (backward), except layer 5 at 100 + 200. With 4 stages the
  // bottleneck is smallest when layer 5 has a stage to itself; every split that does so has the
  // same bottleneck, so the test asks for exactly that, and for a gain over the even split (small:
  // the bottleneck drops from 306 to 300 per microbatch).
  LayerProfile profile;
  for (std::size_t i = 0; i < 8; ++i) {
    profile.names.push_back("layer" + std::to_string(i));
    profile.forward.push_back(i == 5 ? 100.0 : 1.0);
    profile.backward_input.push_back(i == 5 ? 100.0 : 1.0);
    profile.backward_weight.push_back(i == 5 ? 100.0 : 1.0);
  }
  for (const schedule::Plan& plan : {schedule::generate<schedule::OneFOneB>({4, 8}), schedule::generate<schedule::GPipe>({4, 8}),
                                     schedule::generate<schedule::ZeroBubbleH1>({4, 8})}) {
    const RebalanceProposal p = rebalance(plan, profile, {0, 2, 4, 6, 8});
    INFO(describe(p));
    const auto& cuts = p.proposed;
    CHECK(std::find(cuts.begin(), cuts.end(), std::size_t(5)) != cuts.end());
    CHECK(std::find(cuts.begin(), cuts.end(), std::size_t(6)) != cuts.end());
    CHECK(p.proposed_makespan < p.current_makespan);
    CHECK(p.proposed_makespan == best_makespan(plan, profile, 4));
    CHECK(describe(p).find("stage 2: layer5\n") != std::string::npos);
  }
  // Already optimal: the proposal keeps it.
  const auto plan = schedule::generate<schedule::OneFOneB>({4, 8});
  const RebalanceProposal kept = rebalance(plan, profile, {0, 5, 6, 7, 8});
  const RebalanceProposal moved = rebalance(plan, profile, kept.proposed);
  CHECK(moved.proposed == kept.proposed);
  CHECK(moved.proposed_makespan == moved.current_makespan);
}

TEST_CASE("rebalance refuses a current split that does not fit the plan", "[cpu][rebalance]") {
  Rng rng(5);
  const LayerProfile profile = random_profile(rng, 7);
  const auto plan = schedule::generate<schedule::OneFOneB>({4, 8});
  auto message = [&](std::vector<std::size_t> cuts) { return error_message([&] { rebalance(plan, profile, cuts); }); };
  CHECK(message({0, 3, 7}).find("the current split has 2 stages but the plan runs 4 (virtual) stages") != std::string::npos);
  CHECK(message({0, 1, 2, 3, 4, 7}).find("has 5 stages but the plan runs 4") != std::string::npos);
  CHECK(message({0, 4, 2, 5, 7}).find("stage 1 of the current split is empty") != std::string::npos);
  CHECK(message({0, 2, 4, 6}).find("end at layer 7") != std::string::npos);
}

TEST_CASE("profiling the real layers feeds rebalance with the pipeline's own plan and split", "[cpu][rebalance]") {
  using Stages = partition<Mlp, 4>;
  OneFOneB4<float> pipe({.microbatches = 4});
  const auto batch = make_batch<float>(8, 3);
  const LayerProfile profile = profile_layers<Mlp::body, backend::Host<float>>(batch.inputs(), 3);
  REQUIRE(profile.forward.size() == 7);
  REQUIRE(profile.names.size() == 7);
  CHECK(profile.names[0].find("Linear") != std::string::npos);
  CHECK(profile.rows == 8);
  for (std::size_t i = 0; i < 7; ++i) {
    CHECK(profile.forward[i] >= 0);
    CHECK(profile.backward_weight[i] >= 0);
  }
  const std::vector<std::size_t> cuts = stage_cuts<Stages>();
  REQUIRE(valid_split(cuts, 7, 4));
  const RebalanceProposal p = rebalance(pipe.plan(), profile, cuts);
  CHECK(p.proposed_makespan <= p.current_makespan);
  CHECK(describe(p).find("predicted makespan") != std::string::npos);
}

// ---- against the unpipelined network ----------------------------------------------------------

TEST_CASE("1F1B and the unpipelined Network compute the same losses over a few training steps", "[cpu][trainer]") {
  using T = double;
  const optim::AdamW adamw({.lr = 2e-2, .weight_decay = 0.01, .clip_norm = 0.5,
                            .schedule = {.warmup_steps = 2, .total_steps = 5, .min_factor = 0.2}});
  OneFOneB4<T> pipe({.microbatches = 4, .seed = 7});
  MlpNetwork<T> net(7);
  REQUIRE(bitwise_equal(net.parameters(), pipe.parameters()));
  constexpr index_t count = Mlp::body::param_count;
  std::vector<std::vector<T>> slots(2, std::vector<T>(std::size_t(count), T(0)));

  for (int step = 0; step < 5; ++step) {
    const auto batch = make_batch<T>(32, 300 + std::uint64_t(step));
    const StepStats stats = pipe.train_step(batch.inputs(), batch.targets(), adamw);

    // The trainer's update done by hand on the whole model: global-norm clip, then AdamW.
    net.zero_grad();
    const double loss = double(net.forward_backward(batch.inputs(), batch.targets()));
    const ConstView<T> grads{net.gradient_data(), Shape{count}};
    const double norm = std::sqrt(sum_of_squares(net.backend(), grads));
    std::vector<TensorView<T>> views{{slots[0].data(), Shape{count}}, {slots[1].data(), Shape{count}}};
    adamw.update(net.backend(), TensorView<T>{net.parameter_data(), Shape{count}}, grads,
                 std::span<const TensorView<T>>(views), step, optim::clip_factor(norm, adamw.clip_norm()));

    INFO("step " << step);
    CHECK(stats.loss == Approx(loss).epsilon(1e-12));
    CHECK(stats.grad_norm == Approx(norm).epsilon(1e-10));
  }
  const std::vector<T> a = pipe.parameters(), b = net.parameters();
  for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(a[i] == Approx(b[i]).epsilon(1e-9).margin(1e-12));
  CHECK(pipe.updates() == 5);
}
