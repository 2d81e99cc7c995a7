// SPDX-License-Identifier: Apache-2.0
// The seams of the runtime: a step plan computed without threads, and a schedule policy written
// outside the library (a V-shaped placement) that verify, simulate, the explorer's registry and the
// runtime all accept, with the unpipelined Network's gradients; plans written to and read from CSV
// and JSON files, run with schedule::UserPlan; plan fingerprints, which ranks compare.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <unistd.h>

#include "explorer.hpp"
#include "pipeline_test_support.hpp"

using namespace cupipe;
using test::Batch;
using test::Host;

namespace {

/// GPipe over a V: worker w holds virtual stages w and 2p-1-w; every forward of chunk 0, then of
/// chunk 1, then the backwards in reverse.
struct VGPipe {
  static constexpr std::string_view name = "v-gpipe";
  static constexpr std::string_view summary = "a test policy: GPipe on the V-shaped placement";
  static constexpr bool split_backward = false;
  static constexpr schedule::UpdateRule update = schedule::UpdateRule::flush;
  static constexpr int chunks = 2;
  static constexpr int default_batches = 1;
  static constexpr std::string_view check(const schedule::Config& c) {
    return c.chunks != 2 ? "v-gpipe runs exactly 2 chunks per worker" : "";
  }
  static constexpr schedule::Placement placement(const schedule::Config& c) { return schedule::v_shape_placement(c.stages); }
  static constexpr std::vector<std::vector<schedule::Action>> actions(const schedule::Config& c) {
    using schedule::ActionKind;
    std::vector<std::vector<schedule::Action>> out(static_cast<std::size_t>(c.stages));
    for (auto& list : out) {
      for (int chunk : {0, 1})
        for (int j = 0; j < c.microbatches; ++j) list.push_back({ActionKind::F, j, chunk});
      for (int chunk : {1, 0})
        for (int j = 0; j < c.microbatches; ++j) list.push_back({ActionKind::B, j, chunk});
    }
    return out;
  }
};
static_assert(schedule::SchedulePolicy<VGPipe>);
static_assert(schedule::verify<VGPipe>(3, 4));

using Mine = schedule::extend<schedule::Policies, VGPipe>;
using Deep = Sequential<Linear<6, 8>, ReLU, Linear<8, 8>, ReLU, Linear<8, 8>, ReLU, Linear<8, 8>, ReLU, Linear<8, 8>,
                        ReLU, Linear<8, 8>, ReLU, Linear<8, 8>, ReLU, Linear<8, 4>>;

}  // namespace

TEST_CASE("a step plan splits any n >= m into microbatches that differ by at most one row", "[pipeline][step_plan]") {
  const schedule::Plan one_f_one_b = schedule::generate<schedule::OneFOneB>({4, 8});
  const std::vector<int> offsets = schedule::detail::microbatch_versions(one_f_one_b);
  const pipeline::StepPlan p = pipeline::make_step_plan(one_f_one_b, offsets, 13, 5, 0);
  CHECK(p.rows == std::vector<index_t>{2, 2, 2, 2, 2, 1, 1, 1});
  CHECK(p.first == std::vector<index_t>{0, 2, 4, 6, 8, 10, 11, 12});
  CHECK(p.normalizer == std::vector<index_t>(8, 13));  // flush: every loss is a share of the batch mean
  CHECK(p.version == std::vector<int>(8, 5));
  for (index_t n = 8; n < 60; ++n) {
    const pipeline::StepPlan q = pipeline::make_step_plan(one_f_one_b, offsets, n, 0, 0);
    const auto [low, high] = std::minmax_element(q.rows.begin(), q.rows.end());
    REQUIRE(*low >= 1);
    REQUIRE(*high - *low <= 1);
    REQUIRE(q.first.back() + q.rows.back() == n);
  }
  CHECK_THROWS_WITH(pipeline::make_step_plan(one_f_one_b, offsets, 7, 0, 0),
                    Catch::Contains("a batch of 7 samples cannot be split into 8 microbatches"));

  // 2BW: batch t of the step runs on max(t - 1, 0) counted over every batch so far; normalizers are per batch.
  const schedule::Plan two_bw = schedule::generate<schedule::PipeDream2BW>({2, 2, 1, 3});
  const pipeline::StepPlan b = pipeline::make_step_plan(two_bw, schedule::detail::microbatch_versions(two_bw), 12, 0, 3);
  CHECK(b.version == std::vector<int>{2, 2, 3, 3, 4, 4});
  CHECK(b.normalizer == std::vector<index_t>(6, 4));
  // PipeDream: each microbatch is its own update; versions follow the updates before its entry.
  const schedule::Plan pd = schedule::generate<schedule::PipeDream>({2, 2, 1, 2});
  const pipeline::StepPlan d = pipeline::make_step_plan(pd, schedule::detail::microbatch_versions(pd), 8, 10, 0);
  CHECK(d.normalizer == std::vector<index_t>(4, 2));
  CHECK(d.version == std::vector<int>{10, 10, 11, 12});
}

TEST_CASE("a policy defined outside the library runs through verify, simulate, the registry and the runtime",
          "[pipeline][policy]") {
  const schedule::Plan plan = schedule::generate<VGPipe>({3, 4, 2});
  CHECK(plan.placement.worker_of(0) == 0);
  CHECK(plan.placement.worker_of(5) == 0);  // the last virtual stage sits beside the first
  CHECK(plan.placement.worker_of(3) == 2);
  CHECK(schedule::verify(plan));
  const schedule::SimResult sim = schedule::simulate(plan, schedule::Costs{1, 2});
  CHECK(sim.makespan > 0);
  CHECK(sim.peak_activations == std::vector<int>(3, 8));  // 4 microbatches x 2 chunks held on every worker

  // The registry and the explorer take the extended list.
  CHECK(schedule::policy_names<Mine>().ends_with(", zbv, v-half, v-min, dualpipev, v-gpipe"));
  CHECK(schedule::find_policy<Mine>("v-gpipe").default_chunks == 2);
  CHECK_THROWS_WITH(schedule::find_policy("v-gpipe"), Catch::Contains("unknown schedule 'v-gpipe'"));
  explorer::Options o;
  o.schedule = "v-gpipe";
  o.stages = 3;
  o.microbatches = 4;
  o.json = true;
  std::ostringstream captured;
  std::streambuf* old = std::cout.rdbuf(captured.rdbuf());
  const int rc = explorer::explore<Mine>(o);
  std::cout.rdbuf(old);
  CHECK(rc == 0);
  CHECK_THAT(captured.str(), Catch::Contains("\"schedule\":\"v-gpipe\"") && Catch::Contains("\"chunks\":2"));

  // The runtime: 8 virtual stages on 4 workers in a V equal the unpipelined Network.
  using Stages = partition_for<Deep, 4, VGPipe>;
  using Pipe = Pipeline<Stages, VGPipe, Host>;
  static_assert(Pipe::stages == 4);
  STATIC_REQUIRE(Pipe::worker_of(7) == 0);
  STATIC_REQUIRE(Pipe::worker_of(4) == 3);
  for (int m : {1, 3, 4}) {
    INFO("m = " << m);
    Pipe pipe({.microbatches = m, .seed = 11});
    Network<Deep, Host> whole(11);
    const Batch b = test::make_batch(10, 6, 4, 90 + m);
    const StepStats s = pipe.forward_backward(b.inputs(), b.targets());
    const double loss = whole.forward_backward(b.inputs(), b.targets());
    CHECK(test::relative_difference(pipe.gradients(), whole.gradients()) <= 1e-12);
    CHECK(std::abs(s.loss - loss) <= 1e-12 * std::abs(loss));
    std::vector<double> out(std::size_t(10 * 4)), expected(out.size());
    pipe.predict(b.inputs(), TensorView<double>{out.data(), Shape{10, 4}});
    whole.forward(b.inputs(), TensorView<double>{expected.data(), Shape{10, 4}});
    CHECK(test::relative_difference(out, expected) <= 1e-12);
  }
}

namespace {

/// A scratch folder removed when the test ends.
struct ScratchDir {
  std::filesystem::path path = std::filesystem::temp_directory_path() / ("cupipe_plan_" + std::to_string(::getpid()));
  ScratchDir() { std::filesystem::create_directories(path); }
  ~ScratchDir() { std::filesystem::remove_all(path); }
};

/// The plan text with the row `from` replaced by `to` (both "worker,kind,microbatch,chunk").
std::string replace_row(std::string text, const std::string& from, const std::string& to) {
  const std::size_t at = text.find("\n" + from + "\n");
  REQUIRE(at != std::string::npos);
  return text.replace(at + 1, from.size(), to);
}

}  // namespace

TEST_CASE("every policy's plan survives a CSV and a JSON round trip, fingerprint included", "[pipeline][plan_file]") {
  for (const schedule::PolicyInfo& policy : schedule::policy_table()) {
    for (const schedule::Config& c : {schedule::Config{1, 3, policy.default_chunks, policy.default_batches},
                                      schedule::Config{4, 8, policy.default_chunks, policy.default_batches}}) {
      INFO(policy.name << " p = " << c.stages);
      const schedule::Plan plan = policy.generate(c);
      for (const bool json : {false, true}) {
        INFO((json ? "JSON" : "CSV"));
        const schedule::Plan back = json ? io::plan_from_json(io::plan_to_json(plan)) : io::plan_from_csv(io::plan_to_csv(plan));
        CHECK(back.config == plan.config);
        CHECK(back.actions == plan.actions);
        CHECK(back.placement == plan.placement);
        CHECK(back.split_backward == plan.split_backward);
        CHECK(back.update == plan.update);
        CHECK(back.channel_depth == plan.channel_depth);
        CHECK(schedule::fingerprint(back) == schedule::fingerprint(plan));
      }
      // DualPipeV's overlapped pairs travel as kind F& and come back as Action::overlap.
      if (policy.name == "dualpipev") {
        CHECK(io::plan_to_csv(plan).find(",F&,") != std::string::npos);
        CHECK(io::plan_to_json(plan).find("\"kind\": \"F&\"") != std::string::npos);
      }
    }
  }
}

TEST_CASE("a plan's fingerprint changes with anything the plan says", "[pipeline][plan_file]") {
  const schedule::Plan plan = schedule::generate<schedule::DualPipeV>({4, 8, 2});
  const std::string base = schedule::fingerprint(plan);
  CHECK(base.size() == 16);
  CHECK(schedule::fingerprint(schedule::generate<schedule::DualPipeV>({4, 8, 2})) == base);
  auto changed = [&](auto edit) {
    schedule::Plan copy = plan;
    edit(copy);
    return schedule::fingerprint(copy) != base;
  };
  CHECK(changed([](schedule::Plan& p) { std::swap(p.actions[1][3], p.actions[1][4]); }));
  CHECK(changed([](schedule::Plan& p) { p.actions[2].back().microbatch += 1; }));
  CHECK(changed([](schedule::Plan& p) { p.actions[3][0].chunk = 1; }));
  CHECK(changed([](schedule::Plan& p) {
    for (auto& a : p.actions[0])
      if (a.overlap) return void(a.overlap = false);
  }));
  CHECK(changed([](schedule::Plan& p) { p.actions[0].pop_back(); }));
  CHECK(changed([](schedule::Plan& p) { p.actions[0].push_back(p.actions[1].back()), p.actions[1].pop_back(); }));
  CHECK(changed([](schedule::Plan& p) { p.split_backward = false; }));
  CHECK(changed([](schedule::Plan& p) { p.channel_depth = 2; }));
  CHECK(changed([](schedule::Plan& p) { p.update = schedule::UpdateRule::per_microbatch; }));
  CHECK(changed([](schedule::Plan& p) { p.placement = schedule::looped_placement(4, 2); }));
  CHECK(schedule::fingerprint(schedule::generate<schedule::ZeroBubbleV>({4, 8, 2})) != base);
}

TEST_CASE("a malformed plan file names the file, the line and the fault", "[pipeline][plan_file]") {
  const std::string good = io::plan_to_csv(schedule::generate<schedule::OneFOneB>({2, 2}));
  auto message = [](const std::string& text) { return test::error_message([&] { io::plan_from_csv(text, "mine.csv"); }); };
  CHECK_THAT(message(""), Catch::Contains("mine.csv line 1: expected '# cupipe plan 1'"));
  CHECK_THAT(message(replace_row(good, "0,F,0,0", "0,X,0,0")), Catch::Contains("line 5: kind 'X' is not F, F& (overlapped with the next B), B or W"));
  CHECK_THAT(message(replace_row(good, "0,F,0,0", "0,F,zero,0")), Catch::Contains("line 5: microbatch 'zero' is not an integer"));
  CHECK_THAT(message(replace_row(good, "0,F,0,0", "7,F,0,0")), Catch::Contains("line 5: worker 7 is outside 0..1"));
  CHECK_THAT(message(replace_row(good, "0,F,0,0", "0,F,0")), Catch::Contains("line 5: expected 4 fields"));
  std::string no_columns = good.substr(0, good.find("worker,kind"));
  CHECK_THAT(message(no_columns), Catch::Contains("ends before the column line"));
  std::string bad_placement = good;
  bad_placement.replace(bad_placement.find("placement=0.0,1.0"), 17, "placement=0.0,0.0");
  CHECK_THAT(message(bad_placement), Catch::Contains("line 3: placement gives worker 0 chunk 0 twice"));
  CHECK_THAT(test::error_message([] { io::load_plan("/nonexistent/plan.csv"); }),
             Catch::Contains("/nonexistent/plan.csv: cannot open for reading"));
}

TEST_CASE("a malformed JSON plan names the file and the field", "[pipeline][plan_file]") {
  const std::string good = io::plan_to_json(schedule::generate<schedule::OneFOneB>({2, 2}));
  REQUIRE(io::plan_from_json(good).actions == schedule::generate<schedule::OneFOneB>({2, 2}).actions);
  auto message = [](const std::string& text) { return test::error_message([&] { io::plan_from_json(text, "mine.json"); }); };
  auto edit = [&](std::string_view from, std::string_view to) {
    std::string text = good;
    const std::size_t at = text.find(from);
    REQUIRE(at != std::string::npos);
    return text.replace(at, from.size(), to);
  };
  CHECK_THAT(message("{\"format\": \"cupipe plan\",\n \"version\": 1,"), Catch::Contains("mine.json: not a JSON plan") && Catch::Contains("line 2"));
  CHECK_THAT(message("[]"), Catch::Contains("mine.json: expected a JSON object"));
  CHECK_THAT(message(edit("\"cupipe plan\"", "\"plan\"")), Catch::Contains("mine.json: format: expected \"cupipe plan\", found \"plan\""));
  CHECK_THAT(message(edit("\"version\": 1", "\"version\": 2")), Catch::Contains("version: expected 1, found 2"));
  CHECK_THAT(message(edit("\"microbatches\": 2,", "")), Catch::Contains("mine.json: field 'microbatches' is missing"));
  CHECK_THAT(message(edit("\"chunks\"", "\"chunk\"")), Catch::Contains("mine.json: unknown field 'chunk'"));
  CHECK_THAT(message(edit("\"stages\": 2", "\"stages\": \"two\"")), Catch::Contains("stages: expected an integer, found \"two\""));
  CHECK_THAT(message(edit("\"stages\": 2", "\"stages\": 0")), Catch::Contains("must be at least 1"));
  CHECK_THAT(message(edit("\"update\": \"flush\"", "\"update\": \"often\"")), Catch::Contains("update: update 'often' is not flush"));
  CHECK_THAT(message(edit("[[0, 0], [1, 0]]", "[[0, 0], [0, 0]]")), Catch::Contains("mine.json: placement gives worker 0 chunk 0 twice"));
  CHECK_THAT(message(edit("[[0, 0], [1, 0]]", "[[0, 0], [1]]")), Catch::Contains("placement[1]: expected [worker, chunk], found [1]"));
  CHECK_THAT(message(edit("\"kind\": \"F\"", "\"kind\": \"X\"")),
             Catch::Contains("mine.json: actions[0]: kind 'X' is not F, F& (overlapped with the next B), B or W"));
  CHECK_THAT(message(edit("\"worker\": 0,", "\"worker\": 7,")), Catch::Contains("actions[0]: worker 7 is outside 0..1"));
  CHECK_THAT(message(edit("\"microbatch\": 0,", "\"microbatch\": 0.5,")), Catch::Contains("actions[0].microbatch: expected an integer, found 0.5"));
  CHECK_THAT(message(edit("\"chunk\": 0}", "\"chunk\": 0, \"stage\": 1}")), Catch::Contains("actions[0]: unknown field 'stage'"));
}

TEST_CASE("a hand-edited plan runs with UserPlan and equals the Network, a broken one names both actions",
          "[pipeline][plan_file]") {
  ScratchDir scratch;
  const std::filesystem::path file = scratch.path / "plan.csv";
  // Start from 1F1B on 4 stages and 4 microbatches, then edit: stage 1 runs all its forwards before
  // any backward (GPipe's order there, 1F1B's elsewhere), a plan no policy makes.
  const schedule::Plan base = schedule::generate<schedule::OneFOneB>({4, 4});
  io::save_plan(base, file);
  schedule::Plan edited = io::load_plan(file);
  auto& stage1 = edited.actions[1];
  std::stable_partition(stage1.begin(), stage1.end(), [](const schedule::Action& a) { return a.kind == schedule::ActionKind::F; });
  REQUIRE(schedule::verify(edited));
  io::save_plan(edited, file);

  using Stages = partition<Deep, 4>;
  using Pipe = Pipeline<Stages, schedule::UserPlan<>, Host>;
  PipelineOptions options{.microbatches = 4, .seed = 5};
  options.plan = std::make_shared<const schedule::Plan>(io::load_plan(file));
  Pipe pipe(options);
  CHECK(pipe.plan().actions == edited.actions);
  Network<Deep, Host> whole(5);
  const Batch b = test::make_batch(9, 6, 4, 77);
  const StepStats s = test::bounded(60, [&] { return pipe.forward_backward(b.inputs(), b.targets()); });
  const double loss = whole.forward_backward(b.inputs(), b.targets());
  CHECK(test::relative_difference(pipe.gradients(), whole.gradients()) <= 1e-12);
  CHECK(std::abs(s.loss - loss) <= 1e-12 * std::abs(loss));

  // Mismatches are refused before anything runs.
  options.microbatches = 8;
  CHECK_THAT(test::error_message([&] { Pipe wrong(options); }),
             Catch::Contains("the plan is for stages 4, chunks 1, microbatches 4") && Catch::Contains("microbatches 8"));
  options.microbatches = 4;
  CHECK_THAT(test::error_message([&] { Pipeline<Stages, schedule::UserPlan<1, true>, Host> split(options); }),
             Catch::Contains("does not split the backward"));
  CHECK_THAT(test::error_message([&] { Pipeline<Stages, schedule::OneFOneB, Host> own(options); }),
             Catch::Contains("PipelineOptions::plan is set, but 1f1b makes its own plan"));
  options.plan = nullptr;
  CHECK_THAT(test::error_message([&] { Pipe unset(options); }), Catch::Contains("PipelineOptions::plan, which is not set"));

  // A backward moved ahead of its forward: verify names both actions, the pipeline refuses to start.
  std::ifstream in(file);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string broken = replace_row(replace_row(text, "2,F,1,0", "2,TMP"), "2,B,1,0", "2,F,1,0");
  broken = replace_row(broken, "2,TMP", "2,B,1,0");
  options.plan = std::make_shared<const schedule::Plan>(io::plan_from_csv(broken, "broken.csv"));
  const std::string why = test::error_message([&] { Pipe refused(options); });
  CHECK_THAT(why, Catch::Contains("plan failed verification") && Catch::Contains("worker 2") &&
                      Catch::Contains("B1") && Catch::Contains("F1"));

  // The explorer reads the file, verifies and simulates it, and writes plans of its own.
  explorer::Options o;
  o.plan_file = file.string();
  o.json = true;
  for (const char* copy : {"copy.csv", "copy.json"}) {
    o.write_plan = (scratch.path / copy).string();
    std::ostringstream captured;
    std::streambuf* old = std::cout.rdbuf(captured.rdbuf());
    const int rc = explorer::explore(o);
    std::cout.rdbuf(old);
    CHECK(rc == 0);
    CHECK_THAT(captured.str(), Catch::Contains("\"schedule\":\"plan " + o.plan_file + "\""));
    CHECK(io::load_plan(o.write_plan).actions == edited.actions);
    o.plan_file = o.write_plan;  // the JSON copy is written from the CSV copy just read
  }
  std::ifstream json_copy(o.plan_file);
  CHECK(json_copy.get() == '{');
}

TEST_CASE("a plan file's counts, numbers and nesting are bounded (issue #61's fuzzing)", "[pipeline][plan_file]") {
  auto csv = [](const std::string& text) { return test::error_message([&] { io::plan_from_csv(text, "mine.csv"); }); };
  auto json = [](const std::string& text) { return test::error_message([&] { io::plan_from_json(text, "mine.json"); }); };
  const std::string rows = "# placement=0.0\nworker,kind,microbatch,chunk\n0,F,0,0\n0,B,0,0\n";
  // stages x chunks overflowed an int (UBSan) before the placement was checked.
  CHECK_THAT(csv("# cupipe plan 1\n# stages=65536 microbatches=1 chunks=65537\n" + rows),
             Catch::Contains("mine.csv line 4: stages x chunks x microbatches x batches is too large for a plan"));
  // Counts that fit, but need more actions than the file lists: verify would size its tables by them.
  CHECK_THAT(csv("# cupipe plan 1\n# stages=1 microbatches=268435456 chunks=1\n" + rows),
             Catch::Contains("mine.csv: the plan's 1 virtual stages x 268435456 microbatches need at least 536870912 actions "
                             "(an F and a B each), but it lists 2"));
  CHECK_NOTHROW(io::plan_from_csv("# cupipe plan 1\n# stages=1 microbatches=1 chunks=1\n" + rows));
  const std::string head = R"({"format": "cupipe plan", "version": 1, "stages": 1, "microbatches": )";
  const std::string tail = R"(, "placement": [[0, 0]], "actions": [{"worker": 0, "kind": "F", "microbatch": 0, "chunk": 0},)"
                           R"( {"worker": 0, "kind": "B", "microbatch": 0, "chunk": 0}]})";
  CHECK_NOTHROW(io::plan_from_json(head + "1" + tail));
  CHECK_THAT(json(head + "1073741824, \"chunks\": 4" + tail), Catch::Contains("is too large for a plan"));
  CHECK_THAT(json(head + "1000" + tail), Catch::Contains("mine.json: actions: the plan's 1 virtual stages x 1000 microbatches"));
  // Integers get<int>() would wrap (2^64 - 1 to -1, 2^40 to 0), and a number beyond a double, were
  // accepted or escaped as nlohmann's exception.
  CHECK_THAT(json(head + "18446744073709551615" + tail), Catch::Contains("microbatches: expected an integer, found 18446744073709551615"));
  std::string wrapped = head + "1" + tail;
  wrapped.replace(wrapped.find("[[0, 0]]"), 8, "[[1099511627776, 0]]");
  CHECK_THAT(json(wrapped), Catch::Contains("placement[0]: expected [worker, chunk], found [1099511627776,0]"));
  CHECK_THAT(json(head + "1e400" + tail), Catch::Contains("mine.json: not a JSON plan") && Catch::Contains("number overflow"));
  // 300,000 nested arrays overflowed the stack in the message's dump() (ASan: stack-overflow).
  const std::string deep = R"({"format": )" + std::string(300000, '[') + std::string(300000, ']') + "}";
  CHECK_THAT(json(deep), Catch::Contains("mine.json: the JSON nests deeper than 8 levels; a plan needs 3"));
}
