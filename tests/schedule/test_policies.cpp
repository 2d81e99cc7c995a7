// SPDX-License-Identifier: Apache-2.0
// Every policy over the whole grid p <= 16, m <= 64: verify passes, and the simulated bubble, memory
// and weight versions match closed forms or a brute-force run of the semantics.
#include <catch2/catch.hpp>

#include <algorithm>
#include <set>

#include "cupipe/schedule/schedule.hpp"

namespace sch = cupipe::schedule;
using sch::Config;
using sch::PolicyInfo;

namespace {

constexpr double tolerance = 1e-12;

/// Every configuration of the grid a policy accepts.
/// The facts of a shipped policy, by name.
PolicyInfo policy(std::string_view name) { return sch::find_policy(name); }

std::vector<Config> grid(const PolicyInfo& id, int max_stages = 16, int max_microbatches = 64) {
  std::vector<Config> configs;
  const std::vector<int> chunk_counts = id.default_chunks > 1 ? std::vector<int>{2, 3, 4} : std::vector<int>{1};
  for (int p = 1; p <= max_stages; ++p)
    for (int m = 1; m <= max_microbatches; ++m)
      for (int v : chunk_counts) {
        const Config c{p, m, v, id.default_batches};
        if (id.check(c).empty()) configs.push_back(c);
      }
  return configs;
}

/// Brute force of the runtime's weight-version semantics: each stage keeps a ring of its last K
/// versions, so K must cover, at every F and B of microbatch j, latest - v_j + 1 (v_j: the updates
/// stage 0 had applied when j entered, or max(t-1, 0) for 2BW batch t).
std::vector<int> brute_force_versions(const sch::Plan& plan) {
  const Config& c = plan.config;
  const int n = c.total_microbatches();
  std::vector<int> tag(static_cast<std::size_t>(n), 0);
  int stage0_updates = 0;
  for (const auto& a : plan.actions[0]) {
    if (a.kind == sch::ActionKind::F) tag[static_cast<std::size_t>(a.microbatch)] = stage0_updates;
    if (a.kind == sch::ActionKind::B) ++stage0_updates;
  }
  if (plan.update == sch::UpdateRule::double_buffered)
    for (int j = 0; j < n; ++j) tag[static_cast<std::size_t>(j)] = std::max(j / c.microbatches - 1, 0);
  std::vector<int> ring(static_cast<std::size_t>(c.stages), 1);
  for (int s = 0; s < c.stages; ++s) {
    std::set<int> created{0};
    std::vector<int> done_in_batch(static_cast<std::size_t>(c.batches), 0);
    for (const auto& a : plan.actions[static_cast<std::size_t>(s)]) {
      const int v = tag[static_cast<std::size_t>(a.microbatch)];
      REQUIRE(created.count(v) == 1);  // the version this microbatch runs on must exist already
      const int latest = *created.rbegin();
      ring[static_cast<std::size_t>(s)] = std::max(ring[static_cast<std::size_t>(s)], latest - v + 1);
      if (a.kind != sch::ActionKind::B) continue;
      const bool update = plan.update == sch::UpdateRule::per_microbatch ||
                          ++done_in_batch[static_cast<std::size_t>(a.microbatch / c.microbatches)] == c.microbatches;
      if (update) created.insert(latest + 1);
    }
  }
  return ring;
}

}  // namespace

TEST_CASE("every policy plan verifies for p <= 16 and m <= 64", "[schedule][verify]") {
  for (const auto& policy : sch::policy_table()) {
    for (const Config& c : grid(policy)) {
      const sch::VerifyResult result = sch::verify(policy.generate(c));
      INFO(policy.name << " p=" << c.stages << " m=" << c.microbatches << " V=" << c.chunks << ": " << result.message());
      REQUIRE(static_cast<bool>(result));
    }
  }
}

TEST_CASE("GPipe and 1F1B bubble is (p-1)/(m+p-1) with F=1 and B=2", "[schedule][simulate]") {
  for (const PolicyInfo& id : {policy("gpipe"), policy("1f1b")}) {
    for (const Config& c : grid(id)) {
      const int p = c.stages, m = c.microbatches;
      const auto sim = sch::simulate(id.generate(c), sch::Costs{1, 2});
      INFO(id.name << " p=" << p << " m=" << m);
      REQUIRE(std::abs(sim.bubble_fraction - double(p - 1) / (m + p - 1)) <= tolerance);
      REQUIRE(sim.makespan == 3.0 * (m + p - 1));  // closed form: (m + p - 1)(F + B)
      for (int s = 0; s < p; ++s)
        REQUIRE(sim.peak_activations[s] == (id.name == "gpipe" ? m : std::min(p - s, m)));
    }
  }
}

TEST_CASE("transfer latency adds 2(p-1) hand-overs to the 1F1B makespan", "[schedule][simulate]") {
  for (int p = 1; p <= 8; ++p)
    for (int m = p; m <= 16; ++m) {
      const auto sim = sch::simulate<sch::OneFOneB>(p, m, sch::Costs{1, 2, 0, 0.5});
      INFO("p=" << p << " m=" << m);
      REQUIRE(sim.makespan >= 3.0 * (m + p - 1) + 2 * (p - 1) * 0.5);
      const auto gpipe = sch::simulate<sch::GPipe>(p, m, sch::Costs{1, 2, 0, 0.5});
      REQUIRE(gpipe.makespan == 3.0 * (m + p - 1) + 2 * (p - 1) * 0.5);  // closed form for GPipe
    }
}

TEST_CASE("ZB-H1 with F=B=W=1 idles a third of 1F1B in the peak memory of 1F1B", "[schedule][zero-bubble]") {
  const sch::Costs unit{1, 1, 1};
  for (const Config& c : grid(policy("zb-h1"))) {
    const int p = c.stages, m = c.microbatches;
    if (m < p) continue;
    const auto zb = sch::simulate(sch::generate<sch::ZeroBubbleH1>(c), unit);
    const auto base = sch::simulate(sch::generate<sch::OneFOneB>(c), unit);
    INFO("p=" << p << " m=" << m);
    REQUIRE(zb.total_idle() <= base.total_idle() / 3 + tolerance);
    REQUIRE(zb.makespan == 3.0 * m + p - 1);  // closed form: the last stage never waits after its start
    REQUIRE(zb.max_peak_activations() == base.max_peak_activations());
    REQUIRE(zb.max_peak_activations() == std::min(p, m));
  }
}

TEST_CASE("ZB-H2 holds at most 2p-1 and never idles more than ZB-H1", "[schedule][zero-bubble]") {
  for (const sch::Costs& costs : {sch::Costs{1, 1, 1}, sch::Costs{1, 2, 1}, sch::Costs{2, 2, 1}}) {
    for (const Config& c : grid(policy("zb-h2"), 12, 48)) {
      const int p = c.stages, m = c.microbatches;
      const auto h2 = sch::simulate(sch::generate<sch::ZeroBubbleH2>(c), costs);
      const auto h1 = sch::simulate(sch::generate<sch::ZeroBubbleH1>(c), costs);
      INFO("p=" << p << " m=" << m << " F=" << costs.forward << " B=" << costs.backward);
      REQUIRE(h2.makespan <= h1.makespan + tolerance);
      REQUIRE(h2.max_peak_activations() == std::min(2 * p - 1, m));
      // The last stage cannot start before (p-1) forwards: the bound H2 reaches once m >= 2p-1.
      const double bound = m * (costs.forward + costs.backward + costs.weight) + (p - 1) * costs.forward;
      REQUIRE(h2.makespan >= bound - tolerance);
      if (m >= 2 * p - 1 && costs.forward == 1) REQUIRE(h2.makespan == bound);
    }
  }
}

TEST_CASE("Interleaved<V> bubble is (p-1)/(Vm+p-1) when p divides m", "[schedule][interleaved]") {
  for (const Config& c : grid(policy("interleaved"))) {
    const int p = c.stages, m = c.microbatches, v = c.chunks;
    if (m % p != 0) continue;
    const auto sim = sch::simulate(policy("interleaved").generate(c), sch::Costs{1, 2});
    INFO("p=" << p << " m=" << m << " V=" << v);
    REQUIRE(std::abs(sim.bubble_fraction - double(p - 1) / (v * m + p - 1)) <= tolerance);
    REQUIRE(std::abs(sim.makespan - (3.0 * m + 3.0 * (p - 1) / v)) <= tolerance * sim.makespan);
  }
}

TEST_CASE("Interleaved<V> with a short last group is the padded plan without the missing microbatches",
          "[schedule][interleaved]") {
  for (const Config& c : grid(policy("interleaved"))) {
    const int p = c.stages, m = c.microbatches;
    if (m < 2 * p || m % p == 0) continue;
    INFO("p=" << p << " m=" << m << " V=" << c.chunks);
    const sch::Plan plan = sch::generate<sch::Interleaved<2>>(c);
    sch::Plan padded = sch::generate<sch::Interleaved<2>>({p, (m / p + 1) * p, c.chunks});
    for (auto& list : padded.actions) std::erase_if(list, [m](const sch::Action& a) { return a.microbatch >= m; });
    REQUIRE(plan.actions == padded.actions);
    // Still cheaper than 1F1B with the same m, as with full groups.
    const auto inter = sch::simulate(plan, sch::Costs{1, 2});
    const auto base = sch::simulate(sch::generate<sch::OneFOneB>({p, m}), sch::Costs{1, 2});
    REQUIRE(inter.bubble_fraction < base.bubble_fraction);
  }
  CHECK(sch::check<sch::Interleaved<2>>({4, 9, 2}).empty());
  CHECK(sch::verify<sch::Interleaved<2>>(4, 9));
  CHECK(sch::verify<sch::Interleaved<3>>(5, 13));
  // V is the pipeline's chunk count; a run-time plan may ask the same generator for another count.
  CHECK(sch::generate<sch::Interleaved<3>>({4, 8, 2}).placement == sch::looped_placement(4, 2));
  CHECK_THROWS_WITH(sch::generate<sch::Interleaved<2>>({4, 8, 1}), Catch::Contains("at least 2 chunks"));
}

TEST_CASE("ZBV holds 1F1B's memory, reaches 3m + (p-1)/2 with F=B=W=1 and never trails ZB-H1",
          "[schedule][zero-bubble]") {
  for (const Config& c : grid(policy("zbv"))) {
    const int p = c.stages, m = c.microbatches;
    INFO("p=" << p << " m=" << m);
    const sch::Plan plan = sch::generate<sch::ZeroBubbleV>(c);
    REQUIRE(plan.placement == sch::v_shape_placement(p));
    const auto zbv = sch::simulate(plan, sch::Costs{1, 1, 1});
    // 2p chunk-microbatches of half a stage each: p whole-stage microbatches, 1F1B's stage 0.
    REQUIRE(zbv.max_peak_activations() == std::min(2 * p, 2 * m));
    // The last worker starts after p-1 chunk forwards, (p-1)/2, and then has 3m of work.
    const double bound = 3.0 * m + 0.5 * (p - 1);
    REQUIRE(zbv.makespan >= bound);
    if (m >= 2 * p - 1) REQUIRE(zbv.makespan == bound);
    // A fixed pattern, not tuned to unit costs: heavier backwards do not make it trail ZB-H1.
    for (const sch::Costs& costs : {sch::Costs{1, 1, 1}, sch::Costs{1, 2, 1}, sch::Costs{2, 2, 1}, sch::Costs{1, 1.5, 0.5}}) {
      INFO("F=" << costs.forward << " B=" << costs.backward << " W=" << costs.weight);
      const auto h1 = sch::simulate(sch::generate<sch::ZeroBubbleH1>({p, m}), costs);
      REQUIRE(sch::simulate(plan, costs).makespan <= h1.makespan + tolerance);
    }
  }
  CHECK_THROWS_WITH(sch::generate<sch::ZeroBubbleV>({4, 8, 3}), Catch::Contains("exactly 2 chunks"));
}

TEST_CASE("BFS: Interleaved's bubble (p-1)/(Vm+p-1) from m = p on, GPipe's memory, a channel m deep",
          "[schedule][bfs]") {
  for (const Config& c : grid(policy("bfs"))) {
    const int p = c.stages, m = c.microbatches, v = c.chunks;
    INFO("p=" << p << " m=" << m << " V=" << v);
    const sch::Plan plan = sch::generate<sch::BreadthFirst<2>>(c);
    REQUIRE(plan.channel_depth == m);
    const auto sim = sch::simulate(plan, sch::Costs{1, 2});
    REQUIRE(sim.max_peak_activations() == v * m);
    if (m >= p) REQUIRE(std::abs(sim.bubble_fraction - double(p - 1) / (v * m + p - 1)) <= tolerance);
  }
  // With one message per channel the last worker blocks handing chunk 0's outputs back to worker 0,
  // which is still running chunk 0's forwards: verify finds the deadlock the declared depth avoids.
  sch::Plan shallow = sch::generate<sch::BreadthFirst<2>>({2, 8, 2});
  shallow.channel_depth = 1;
  const sch::VerifyResult result = sch::verify(shallow);
  REQUIRE_FALSE(result);
  CHECK(result.message().find("deadlock") != std::string_view::npos);
}

TEST_CASE("weight versions are 1 for flush and 2 for 2BW and PipeDream matches a brute force", "[schedule][weights]") {
  for (const PolicyInfo& id : sch::policy_table())
    if (id.update == sch::UpdateRule::flush)
      for (const Config& c : grid(id, 8, 16)) REQUIRE(sch::weight_versions(id.generate(c)) == std::vector<int>(c.stages, 1));
  for (const PolicyInfo& id : {policy("pipedream"), policy("2bw")}) {
    for (int batches : {1, 2, 3}) {
      for (int p = 1; p <= 16; ++p) {
        for (int m = 1; m <= 64; m += (m < 20 ? 1 : 7)) {
          const Config c{p, m, 1, batches};
          if (!id.check(c).empty()) continue;
          const sch::Plan plan = id.generate(c);
          const auto versions = sch::weight_versions(plan);
          INFO(id.name << " p=" << p << " m=" << m << " batches=" << batches);
          REQUIRE(versions == brute_force_versions(plan));
          if (id.name == "2bw" && m >= p && batches > 1)
            REQUIRE(*std::max_element(versions.begin(), versions.end()) == 2);
        }
      }
    }
  }
}

TEST_CASE("PipeDream2BW rejects too few microbatches across batches", "[schedule][weights]") {
  CHECK(sch::check<sch::PipeDream2BW>({8, 2, 1, 2}).find("needs microbatches >= stages - 1") != std::string_view::npos);
  CHECK(sch::check<sch::PipeDream2BW>({8, 2, 1, 1}).empty());
  CHECK(sch::verify<sch::PipeDream2BW>(4, 3));  // m = p - 1 still works, with 2 versions
  CHECK(sch::simulate<sch::PipeDream2BW>(4, 3, {}).max_weight_versions() == 2);
}
