// SPDX-License-Identifier: Apache-2.0
// Trains a GPT-2-style transformer with a pipeline schedule: byte-level text (Debian's fortunes by
// default, or any file or folder) or llm.c token shards; on the CPU (host backend), under
// mpirun/srun with --dp and --tp (stages x replicas x tensor-parallel processes, host backend), or with --backend cuda on GPUs
// in one process. Prints per-step loss and tokens/s (on CUDA also TFLOP/s and MFU against the GPUs'
// measured GEMM rate), held-out loss and bits per byte at each evaluation, a sample from the model at
// the end, and one JSON summary line; saves and resumes checkpoints with nanoGPT's parameter names.
//
//   gpt_train --schedule 1f1b --stages 2 --steps 2000 --sample 300
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <type_traits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cli_checks.hpp"
#include "launch.hpp"
#include "plan_auto.hpp"
#include "trainer.hpp"
#include "trainer_schedules.hpp"
#include "cupipe/planner/calibrate_experts.hpp"

using namespace gpt_trainer;
using cupipe::examples::Launcher;
using cupipe::examples::non_negative;
using cupipe::examples::positive;

namespace {

/// The split of `Model` this trainer compiles for a virtual stage count (partition<> into 1, 2 or 4);
/// empty for any other count.
template <class Model>
std::vector<std::size_t> compiled_cuts(int virtual_stages) {
  std::vector<std::size_t> cuts;
  if (virtual_stages == 1 || virtual_stages == 2 || virtual_stages == 4)
    with_stage_count<1, 2, 4>(virtual_stages, [&]<int N>() { cuts = stage_cuts<partition<Model, std::size_t(N)>>(); });
  return cuts;
}

/// Takes the planned layout into the flags the trainer runs by, with its predictions.
void take_layout(gpt_trainer::Flags& f, const planner::Layout& best) {
  f.zero = best.zero;
  f.schedule = best.schedule;
  f.stages = best.stages;
  f.microbatches = best.microbatches;
  f.predicted_step_seconds = best.step_seconds;
  f.predicted_activation_bytes = best.peak_activation_bytes;
  f.predicted_state_bytes = best.resting_state_bytes;
  f.predicted_activation_low_bytes = best.peak_activation_low_bytes;
  f.predicted_activation_high_bytes = best.peak_activation_high_bytes;
}

/// --plan auto with --experts: the mixture of experts `config` profiled here on `batch` (every
/// expert in one process), its layers sized as one rank of expert groups of --ep
/// (gpt::ExpertParallelModel: a share of the experts), and the all-to-all timed over the launch's
/// expert group on every rank; planned among the schedules this trainer runs it with: the flush
/// ones at 1 or 2 stages and DualPipeV at 2 (1F1B and DualPipeV with --ep above 1). The report
/// gives the all-to-all time exposed with and without DualPipeV's pairs.
template <gpt::Config config>
planner::Layout plan_experts_in_groups(gpt_trainer::Flags& f, ConstView<std::int32_t> batch, index_t sequences,
                                       comm::Communicator* comm, std::optional<planner::CostModel>& profiled) {
  using Model = gpt::Model<config>;
  // The all-to-all over the --ep group, alone and inside a step of this rank's share of the model
  // (each exchange waiting for the group's slowest rank, as in training): the planner prices the second.
  planner::LinkCost alone, exchange;
  if (comm && f.ep > 1) {
    alone = planner::all_to_all_cost(*comm);
    const double values_per_row = double(config.top_k * config.channels);
    const auto in_step = [&]<int EP>() {
      return planner::all_to_all_in_step<gpt::ExpertParallelModel<config, EP>, backend::Host<T>>(
          *comm, batch, config.context, values_per_row, int(sizeof(T)));
    };
    exchange = f.ep == 2 ? in_step.template operator()<2>() : in_step.template operator()<4>();
    if (comm->topology().rank == 0)
      std::printf("all-to-all over expert groups of %d: alone %.1f us + %.3f GB/s, inside a step %.1f us + %.3f GB/s "
                  "(the planner prices the second)\n",
                  f.ep, alone.latency * 1e6, alone.bytes_per_second / 1e9, exchange.latency * 1e6,
                  exchange.bytes_per_second / 1e9);
  }
  const auto calibrate = [&] {  // every expert in one process: profiled once for every group size
    if (!profiled)
      profiled = planner::calibrate<Model, backend::Host<T>>(batch, 3, config.context,
                                                             cupipe::examples::profiled_microbatch_counts(sequences));
    planner::CostModel model = *profiled;
    if (f.ep == 2) model = planner::sized_as<typename gpt::ExpertParallelModel<config, 2>::body>(std::move(model));
    if (f.ep == 4) model = planner::sized_as<typename gpt::ExpertParallelModel<config, 4>::body>(std::move(model));
    model.expert_ranks = f.ep;
    model.all_to_all_latency = exchange.latency;
    model.all_to_all_bytes_per_second = exchange.bytes_per_second;
    return model;
  };
  const auto split = [](int virtual_stages) { return compiled_cuts<Model>(virtual_stages); };
  std::vector<std::string> built = cupipe::examples::built_schedule_names(), schedules;
  if (built.empty())  // this build has every schedule
    for (const schedule::PolicyInfo& p : schedule::policy_table()) built.emplace_back(p.name);
  for (const std::string& name : built) {
    const bool flush = cupipe::examples::family_of_name(name) == cupipe::examples::ScheduleFamily::flush;
    if (f.ep > 1 ? name == "1f1b" || name == "dualpipev" : flush || name == "dualpipev") schedules.push_back(name);
  }
  cupipe::examples::RankChoice ranks;
  ranks.refuses = [](std::string_view schedule, int p, int, int, int) -> std::string {
    if (schedule == "dualpipev" && p != 2) return "this trainer runs dualpipev with experts on 2 stages";
    return {};
  };
  // Without expert groups the plan picks the ZeRO stage too, unless --zero named one; the runtime
  // refuses ZeRO beside expert groups (and the planner does not propose it).
  const std::vector<int> zero_stages = f.zero_given ? std::vector<int>{f.zero} : std::vector<int>{0, 1, 2, 3};
  return cupipe::examples::plan_auto(comm, calibrate, f.workers, f.batch, {1, 2}, split, schedules, ranks, zero_stages);
}

/// plan_experts_in_groups for --ep, or with --plan-ep for each group size named (the launch's
/// communicator re-formed in groups of it, the all-to-all timed inside a step over them): the
/// fastest predicted plan sets f.ep, and the communicator is left in its groups.
template <gpt::Config config>
planner::Layout plan_experts(gpt_trainer::Flags& f, ConstView<std::int32_t> batch, index_t sequences, Launcher* launcher) {
  std::optional<planner::CostModel> profiled;
  const auto comm = [&] { return launcher ? launcher->launch().communicator.get() : nullptr; };
  if (f.plan_ep.empty()) return plan_experts_in_groups<config>(f, batch, sequences, comm(), profiled);
  CUPIPE_REQUIRE(comm() != nullptr, "--plan-ep: expert-parallel groups are processes; run under mpirun or srun");
  const int stages = comm()->topology().stages;
  std::vector<std::pair<int, planner::Layout>> tried;
  for (const int group : f.plan_ep) {
    if (group != comm()->topology().experts) launcher->reshape(stages, 1, 1, group);
    f.ep = group;
    tried.emplace_back(group, plan_experts_in_groups<config>(f, batch, sequences, comm(), profiled));
  }
  const auto best = std::min_element(tried.begin(), tried.end(),
                                     [](const auto& a, const auto& b) { return a.second.step_seconds < b.second.step_seconds; });
  if (comm()->topology().rank == 0) {
    std::printf("--plan-ep:");
    for (const auto& [group, layout] : tried)
      std::printf(" expert groups of %d: %s p=%d m=%d, step %.2f ms predicted (all-to-all exposed %.3f ms);", group,
                  layout.schedule.c_str(), layout.stages, layout.microbatches, layout.step_seconds * 1e3,
                  layout.exposed_all_to_all_seconds * 1e3);
    std::printf(" chosen: --ep %d\n", best->first);
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    if (best->first > 1 && planner::processes_on_this_node() > int(cores))
      std::printf("caveat: %d processes share %u cores here, and an exchange inside a step also waits for its partner "
                  "rank's turn on a core, which the price leaves out: on the 2-core VM groups of 2 measured slower than "
                  "groups of 1 (docs/benchmarks.md, 2026-12-06 afternoon)\n",
                  planner::processes_on_this_node(), cores);
  }
  f.ep = best->first;
  if (f.ep != comm()->topology().experts) launcher->reshape(stages, 1, 1, f.ep);
  return best->second;
}

/// --plan auto: calibrates the planner's cost model on the first batch of training sequences here
/// (every layer, the loss, the optimizer step, one core per worker), plans a run in this process on
/// f.workers workers with the stage counts and splits this program compiles (partition<> into 1, 2
/// or 4 virtual stages), prints the report and sets f's schedule, stages and microbatches.
///
/// Under mpirun (`launcher` up with a communicator), the launch fixes the replicas (--dp) and a
/// replica's processes are its stages x tensor-parallel ranks x context-parallel ring: the first rank
/// calibrates on its replica's share of the batch, with one rank's part of each tensor-parallel split
/// that fits (f.plan_tensor; fp32), every rank plans from that (plan_across_ranks), and the planner
/// chooses the tensor degree or the ring size (f.plan_context; fp32, unpacked), the schedule and
/// the microbatches. A degree or a ring above 1 sets f.tp or f.cp and re-forms the launch's
/// communicator.
void plan_layout(gpt_trainer::Flags& f, const std::vector<std::int32_t>& tokens, Launcher* launcher) {
  using Model = gpt::Model<gpt::tiny>;
  constexpr index_t context = gpt::tiny.context;
  comm::Communicator* comm = launcher ? launcher->launch().communicator.get() : nullptr;
  const int replicas = comm ? comm->topology().replicas : 1;
  const index_t sequences = std::min<index_t>(f.batch / replicas, index_t(tokens.size()) / context);
  CUPIPE_REQUIRE(sequences >= 2, "--plan auto: the planner profiles a batch of at least 2 sequences of ", context,
                 " tokens", comm ? " per replica" : "", ", but there are ", sequences);
  const ConstView<std::int32_t> batch{tokens.data(), Shape{sequences * context, 1}};
  if (f.experts > 0) {
    if (f.plan_tensor_given || f.plan_context_given)
      CUPIPE_THROW(f.plan_tensor_given ? "--plan-tensor" : "--plan-context", ": this trainer's mixtures of experts run "
                   "without tensor or context parallelism; leave it out with --experts");
    take_layout(f, moe_preset(f) == 1 ? plan_experts<moe_top1>(f, batch, sequences, launcher)
                                      : plan_experts<moe_top2>(f, batch, sequences, launcher));
    return;
  }
  const bool bf16 = f.precision == "bf16";
  const auto above_one = [](const std::vector<int>& degrees) {
    return std::any_of(degrees.begin(), degrees.end(), [](int x) { return x > 1; });
  };
  // The tensor-parallel degrees that fit a replica's processes (this trainer's tensor-parallel
  // model runs 1f1b on 1 or 2 stages, in fp32), and the context-parallel rings (fp32, unpacked).
  cupipe::examples::RankChoice ranks;
  const bool asks_tensor = f.plan_tensor_given && above_one(f.plan_tensor);
  const bool asks_context = f.plan_context_given && above_one(f.plan_context);
  if (asks_tensor || asks_context) {
    const char* flag = asks_tensor ? "--plan-tensor" : "--plan-context";
    if (!comm)
      CUPIPE_THROW(flag, ": ", asks_tensor ? "tensor-parallel ranks" : "a context-parallel ring's ranks",
                   " are processes; run under mpirun or srun (one process plans its stages only)");
    if (bf16)
      CUPIPE_THROW(flag, ": this trainer has no ", asks_tensor ? "tensor-parallel" : "context-parallel",
                   " model in bf16; leave it out with --precision bf16");
    if (asks_context && f.pack)
      CUPIPE_THROW("--plan-context: packed sequences do not split over a context-parallel ring; leave out --pack or "
                   "--plan-context");
  }
  if (comm && !bf16) {
    const int per_replica = comm->topology().stages;
    if (!f.pack) ranks.context_degrees = f.plan_context;
    // A tensor-parallel degree pairs with no ring (ranks.tensor_with_context is off): it is a
    // candidate, and its split is profiled, only where a ring of 1 is.
    const bool unsplit = std::find(ranks.context_degrees.begin(), ranks.context_degrees.end(), 1) != ranks.context_degrees.end();
    ranks.tensor_degrees.clear();
    for (const int t : f.plan_tensor)
      if (t == 1 || (unsplit && per_replica % t == 0 && per_replica / t <= 2)) ranks.tensor_degrees.push_back(t);
    ranks.measure_sum = [launcher] { return planner::tensor_sum_cost(*launcher->communicator(1, 2)); };
    ranks.measure_replica_sum = [launcher] { return planner::replica_sum_bandwidth(*launcher->communicator(1, 1)); };
    // The degrees above already leave 1 or 2 stages.
    ranks.refuses = [](std::string_view schedule, int, int, int t, int) -> std::string {
      if (t > 1 && schedule != "1f1b") return "this trainer's tensor-parallel model runs 1f1b on 1 or 2 stages";
      return {};
    };
  }
  // The model profiled in the precision it will train in (bf16: Host<bfloat16, float>, 2-byte
  // activations and messages, 4-byte gradients and optimizer state).
  const auto calibrate = [&] {
#if CUPIPE_TRAINER_HAS_BF16  // a flush-only build refused --precision bf16 before any data loaded
    if (bf16)
      return planner::calibrate<Model, backend::Host<cupipe::bfloat16, float>>(batch, 3, context,
                                                                               cupipe::examples::profiled_microbatch_counts(sequences));
#endif
    planner::CostModel model =
        planner::calibrate<Model, backend::Host<T>>(batch, 3, context, cupipe::examples::profiled_microbatch_counts(sequences));
    for (const int t : ranks.tensor_degrees) {
      if (t == 2)
        model.tensor_variants.push_back(
            planner::calibrate_tensor_parts<gpt::TensorParallelModel<gpt::tiny, 2>, backend::Host<T>>(batch, 2, 3, context));
      if (t == 4)
        model.tensor_variants.push_back(
            planner::calibrate_tensor_parts<gpt::TensorParallelModel<gpt::tiny, 4>, backend::Host<T>>(batch, 4, 3, context));
    }
    return model;
  };
  const auto split = [](int virtual_stages) { return compiled_cuts<Model>(virtual_stages); };
  // With replicas the plan picks the ZeRO stage too, unless --zero named one.
  const std::vector<int> zero_stages = f.zero_given ? std::vector<int>{f.zero} : std::vector<int>{0, 1, 2, 3};
  const planner::Layout best = cupipe::examples::plan_auto(
      comm, calibrate, f.workers, f.batch, {1, 2, 4}, split, {}, ranks, zero_stages);
  take_layout(f, best);
  if (best.tensor > 1 || best.context > 1) {
    f.tp = best.tensor;
    f.cp = best.context;
    launcher->reshape(best.stages, best.tensor, best.context);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"Train a GPT-2-style transformer with a pipeline schedule (cupipe)"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--data", f.data, "text file or folder (byte-level, vocabulary 256)")->capture_default_str();
  app.add_option("--shards", f.shards, "llm.c token shard (.bin) or folder of them, instead of --data");
  app.add_option("--val-shards", f.val_shards, "held-out llm.c shards (default: the last --held-out of --shards)");
  app.add_option("--preset", f.preset, "model size: tiny (V 256, T 64, 4 x C 128) or gpt2-124m (V 50304, T 1024, "
                 "12 x C 768; --backend cuda)")
      ->capture_default_str()
      ->check(CLI::IsMember({"tiny", "gpt2-124m"}));
  app.add_option("--schedule", f.schedule, "one of: " + schedule::policy_names() + " (flush schedules: the head is tied)")
      ->capture_default_str();
  app.add_option("--stages", f.stages, "pipeline stages: 1, 2 or 4")->capture_default_str();
  app.add_option("--microbatches", f.microbatches, "microbatches per step")->capture_default_str()->check(positive);
  app.add_option("--batch", f.batch, "sequences per step")->capture_default_str()->check(positive);
  app.add_option("--steps", f.steps, "optimizer steps")->capture_default_str()->check(positive);
  app.add_option("--lr", f.lr, "peak learning rate (linear warm-up, cosine decay)")->capture_default_str()->check(positive);
  app.add_option("--warmup", f.warmup, "warm-up steps")->capture_default_str()->check(non_negative);
  app.add_option("--min-lr", f.min_lr, "final learning rate as a fraction of --lr")->capture_default_str()->check(non_negative);
  app.add_option("--weight-decay", f.weight_decay, "AdamW's decoupled weight decay")->capture_default_str()->check(non_negative);
  app.add_option("--weight-decay-on", f.weight_decay_on,
                 "matrices: decay the 2-D weights and the embeddings, not biases or LayerNorm (GPT-2, nanoGPT); all: "
                 "every parameter")
      ->capture_default_str()
      ->check(CLI::IsMember({"matrices", "all"}));
  app.add_option("--clip", f.clip, "global gradient-norm clip (0: none)")->capture_default_str()->check(non_negative);
  app.add_option("--seed", f.seed, "initialisation, data order and sampling seed")->capture_default_str();
  app.add_option("--data-order", f.data_order,
                 "shuffled: each epoch a permutation of the training windows drawn from --seed; in-order: the "
                 "windows as they lie in the corpus")
      ->capture_default_str()
      ->check(CLI::IsMember({"shuffled", "in-order"}));
  app.add_option("--eval-every", f.eval_every, "steps between held-out evaluations (0: only at the end)")
      ->capture_default_str()
      ->check(non_negative);
  app.add_option("--eval-batches", f.eval_batches, "held-out batches per evaluation")->capture_default_str()->check(positive);
  app.add_option("--held-out", f.held_out, "fraction of the corpus held out (its end)")->capture_default_str()->check(positive);
  CLI::Option* pack = app.add_flag("--pack", f.pack,
               "packed sequences: a document begins at each --pack-separator token; attention stays within each "
               "document and positions restart at its first token (training and the held-out loss)");
  app.add_option("--pack-separator", f.pack_separator,
                 "with --pack, the token that begins a document (default: <|endoftext|> 50256 in llm.c shards, '%' "
                 "(37) in byte-level text, the line fortune files put between two texts)")
      ->check(CLI::Range(0, 1 << 30))
      ->needs(pack);
  app.add_option("--sample", f.sample, "tokens to generate after training (0: none)")->capture_default_str()->check(non_negative);
  app.add_option("--prompt", f.prompt, "text the sample continues")->capture_default_str();
  app.add_option("--temperature", f.temperature, "sampling temperature")->capture_default_str()->check(positive);
  app.add_option("--sample-top-k", f.sample_top_k, "sample among the k likeliest tokens (0: all)")->capture_default_str()->check(non_negative);
  CLI::Option* experts = app.add_option("--experts", f.experts,
                 "mixture of experts: every second block's MLP becomes this many experts of its shape, a router "
                 "picking --top-k per token (0: dense; built: 8)")
      ->capture_default_str()
      ->check(non_negative);
  app.add_option("--top-k", f.expert_top_k, "with --experts, the experts each token goes to (built: 1, or 2 with --capacity 1.25)")
      ->capture_default_str()
      ->check(positive)
      ->needs(experts);
  app.add_option("--capacity", f.capacity,
                 "with --experts, an expert takes at most capacity x T x top-k / experts tokens of a sequence and "
                 "drops the rest (0: dropless)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber)
      ->needs(experts);
  CLI::Option* ep = app.add_option("--ep", f.ep,
                 "with --experts, expert-parallel ranks per group: N of the --dp replicas of a stage share every MoE "
                 "block's experts (each holds experts / N), tokens travel to their expert's rank and back by "
                 "all-to-all; 2 or 4, dividing --dp, with --schedule 1f1b or dualpipev")
      ->capture_default_str()
      ->check(CLI::IsMember({1, 2, 4}))
      ->needs(experts);
  app.add_flag("--paired-turns", f.paired_turns,
               "with --experts, --ep and --schedule dualpipev: each overlapped F&B pair's F and B take turns, one "
               "computing while the other's all-to-all is in flight (default: the F, then the B; the same numbers)")
      ->needs(experts);
  app.add_option("--save", f.save, "checkpoint prefix: PREFIX.safetensors (nanoGPT names) and PREFIX.state.safetensors");
  app.add_option("--save-every", f.save_every, "also save every N steps")->check(non_negative);
  app.add_option("--resume", f.resume, "checkpoint prefix to resume from (weights, AdamW state, data position)");
  app.add_option("--max-steps", f.max_steps, "stop (evaluate, save) after this many steps in total; the schedule "
                 "still spans --steps (0: no limit)")->check(non_negative);
  app.add_option("--max-seconds", f.max_seconds, "stop (evaluate, save) after this much training time (0: no limit)")
      ->check(non_negative);
  cupipe::examples::add_check_equivalence(app, f.check_equivalence);
  cupipe::examples::add_hand_over(app, f.hand_over);
  app.add_option("--post-validation", f.post_validation,
                 "run N steps at a time with optimizer post-validation: no flush between them, the global gradient "
                 "norm checked a step late and an update that should have clipped redone (flush schedules whose "
                 "tied wte and lm_head share a worker: zbv, v-half, v-min, dualpipev; one process; the weights are "
                 "bitwise those without it); 0: off")
      ->capture_default_str()
      ->check(non_negative);
  auto* plan = app.add_option("--plan", f.plan,
                               "auto: profile the model here and let the planner choose --schedule, --stages and "
                               "--microbatches (host backend, --preset tiny; under mpirun the processes over --dp are "
                               "the stages x --tp x --cp, and it chooses --tp or --cp too (see --plan-tensor and "
                               "--plan-context))")
                   ->check(CLI::IsMember({"auto"}));
  app.add_option("--workers", f.workers, "with --plan auto: workers (cores) the plan may use; 0: the cores, at most 4")
      ->check(non_negative)
      ->needs(plan);
  auto* plan_tensor = app.add_option("--plan-tensor", f.plan_tensor,
                 "with --plan auto under mpirun: the tensor-parallel degrees the planner may choose (of 1,2,4; a "
                 "degree must divide the processes per replica, leaving 1 or 2 stages)")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::IsMember({1, 2, 4}))
      ->needs(plan);
  auto* plan_context = app.add_option("--plan-context", f.plan_context,
                 "with --plan auto under mpirun: the context-parallel ring sizes the planner may choose (of 1,2,4; "
                 "fp32, without --pack; a ring is not combined with a tensor-parallel degree)")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::IsMember({1, 2, 4}))
      ->needs(plan);
  app.add_option("--plan-ep", f.plan_ep,
                 "with --plan auto --experts under mpirun: the expert-parallel group sizes to weigh (of 1,2,4; each "
                 "dividing --dp); each one's all-to-all is timed inside a step and the fastest predicted plan sets --ep")
      ->delimiter(',')
      ->check(CLI::IsMember({1, 2, 4}))
      ->needs(plan)
      ->needs(experts)
      ->excludes(ep);
  for (const char* name : {"--schedule", "--stages", "--microbatches"}) plan->excludes(app.get_option(name));
  app.add_option("--progress", f.progress, "auto, bar, lines or none")->capture_default_str()->check(CLI::IsMember({"auto", "bar", "lines", "none"}));
  app.add_option("--trace", f.trace, "write a Chrome trace (measured vs simulated) of the last step here");
  app.add_option("--backend", f.backend, "host (CPU); cuda needs a build with CUDA")->capture_default_str()->check(CLI::IsMember({"host", "cuda"}));
  app.add_option("--devices", f.devices, "GPU of each stage, e.g. 0,0,1,1 (with --backend cuda)");
  CLI::Option* math = app.add_option("--math", f.math, "GEMM arithmetic on CUDA: tf32 (tensor cores) or fp32 (exact)")
                          ->capture_default_str()
                          ->check(CLI::IsMember({"fp32", "tf32"}));
  app.add_option("--precision", f.precision,
                 "fp32, or bf16: weights in use, activations and messages in bfloat16; master weights, gradients, "
                 "AdamW state, statistics and the loss in fp32 (every schedule, on the host and on cuda); or "
                 "fp8-block, fp8-delayed: bf16 with every layer GEMM in FP8, DeepSeek-V3's block scaling or "
                 "TransformerEngine's delayed scaling, emulated on the host (gpipe, 1f1b, zb-h1, zb-h2)")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "bf16", "fp8-block", "fp8-delayed"}));
  app.add_flag("--zero{1}", f.zero,
               "ZeRO-1: each of the --dp replicas keeps the AdamW state of 1/dp of the parameters and the updated "
               "shards are gathered (the weights are those without it, to rounding); --zero=2, ZeRO-2: the summed "
               "gradients too, each stage's reduce-scattered as soon as its backward is done; --zero=3, ZeRO-3: the "
               "weights too, each stage's gathered over the replicas before its actions and released after them")
      ->check(CLI::Range(0, 3));
  app.add_option("--tp", f.tp,
                 "tensor-parallel ranks per stage: each block's attention split by heads and MLP by width, the "
                 "embedding, head and loss by vocabulary (Megatron); run under mpirun/srun with stages x dp x tp "
                 "processes; 2 or 4, with --schedule 1f1b and --stages 1 or 2")
      ->capture_default_str()
      ->check(CLI::IsMember({1, 2, 4}));
  plan->excludes(app.get_option("--tp"));  // the plan chooses it
  app.add_option("--cp", f.cp,
                 "context-parallel ranks per ring: each sequence split over N processes (rank r holds chunks r and "
                 "2N-1-r of 2N), attention computed round the ring, losses and gradients summed over it; run under "
                 "mpirun/srun with stages x dp x cp processes (host backend, fp32; not with --tp or --pack; --plan "
                 "auto chooses it)")
      ->capture_default_str()
      ->check(positive);
  plan->excludes(app.get_option("--cp"));
  app.add_option("--rank-order", f.rank_order,
                 "how ranks map to (stage, replica, t), t always innermost: stages-outermost (a stage's replicas on "
                 "nearby ranks, for the gradient sums) or replicas-outermost (a replica's pipeline on consecutive ranks)")
      ->capture_default_str()
      ->check(CLI::IsMember({"stages-outermost", "replicas-outermost"}));
  app.add_option("--dp", f.dp, "data-parallel replicas; run under mpirun/srun with stages x dp processes")
      ->capture_default_str()
      ->check(positive);
  app.add_option("--timeout", f.timeout,
                 "seconds a stage waits for another (a transfer, or a sum over ranks) before failing; 0: no limit")
      ->capture_default_str()
      ->check(non_negative);
  CLI11_PARSE(app, argc, argv);
  f.plan_tensor_given = plan_tensor->count() > 0;
  f.plan_context_given = plan_context->count() > 0;
  f.zero_given = app.count("--zero") > 0;
  if (f.zero < 0) f.zero = 0;  // CLI11 reads a flag's "=0" as "false" and counts it down to -1: --zero=0 is off

  Launcher launcher;  // outside the try: the catch ends every rank through it
  try {
    if (f.backend != "cuda" && (!f.devices.empty() || math->count() > 0))
      CUPIPE_THROW(f.devices.empty() ? "--math" : "--devices", " applies to GPUs and needs --backend cuda");
#if !CUPIPE_TRAINER_HAS_CUDA
    if (f.backend == "cuda")
      CUPIPE_THROW("--backend cuda: this trainer was built without CUDA (configure where nvcc is found to build it)");
#endif
    if (f.precision == "bf16") {
#if !CUPIPE_TRAINER_HAS_BF16
      if (f.backend == "host")
        CUPIPE_THROW("--precision bf16 on the host backend is not in this build, which was configured with "
                     "-DCUPIPE_TRAINER_SCHEDULES=", cupipe::examples::trainer_setting,
                     "; configure without it for bf16 training on the CPU");
#endif
      if (math->count() > 0)
        CUPIPE_THROW("--math sets how fp32 GEMMs run on CUDA; with --precision bf16 every GEMM takes bf16 inputs and "
                     "accumulates in fp32");
    }
    if (f.precision.starts_with("fp8")) {
#if !CUPIPE_TRAINER_HAS_FP8
      CUPIPE_THROW("--precision ", f.precision, " is not in this build, which was configured with "
                   "-DCUPIPE_TRAINER_SCHEDULES=", cupipe::examples::trainer_setting,
                   "; configure without it for FP8 training on the CPU");
#endif
      if (f.backend != "host")
        CUPIPE_THROW("--precision ", f.precision, " is the host's FP8 emulation; FP8 GEMMs on CUDA are not built yet "
                     "(issue #59): use --backend host, or --precision bf16 on cuda");
      if (f.plan == "auto")
        CUPIPE_THROW("--plan auto profiles fp32 or bf16; with --precision ", f.precision,
                     " name --schedule, --stages and --microbatches");
      if (cupipe::examples::family_of_name(f.schedule) != cupipe::examples::ScheduleFamily::flush)
        CUPIPE_THROW("--precision ", f.precision, " trains the flush schedules (gpipe, 1f1b, zb-h1, zb-h2), not --schedule ",
                     f.schedule);
    }
    if (f.experts > 0) {
      if (const std::string why = moe_presets_refusal(f); !why.empty()) CUPIPE_THROW(why);
      for (const int group : f.plan_ep)
        if (f.dp % group != 0)
          CUPIPE_THROW("--plan-ep ", group, ": an expert-parallel group is a share of the --dp ", f.dp,
                       " replicas, so its size must divide it");
        else if (group > 1 && f.zero > 0)
          CUPIPE_THROW("--plan-ep ", group, ": expert groups run without --zero (", f.zero, " was given)");
      if (f.backend != "host" || f.precision != "fp32" || f.preset != "tiny" || f.tp > 1 || f.cp > 1)
        CUPIPE_THROW("--experts trains the tiny preset on the host backend in fp32, without --tp and --cp (",
                     f.backend != "host" ? "--backend " + f.backend : f.precision != "fp32" ? "--precision " + f.precision
                     : f.preset != "tiny" ? "--preset " + f.preset : f.tp > 1 ? "--tp" : "--cp",
                     " was given)");
      const bool flush = cupipe::examples::family_of_name(f.schedule) == cupipe::examples::ScheduleFamily::flush;
      if (!(flush && f.stages <= 2) && !(f.schedule == "dualpipev" && f.stages == 2))
        CUPIPE_THROW("--experts trains the flush schedules (gpipe, 1f1b, zb-h1, zb-h2) at --stages 1 or 2, and dualpipev "
                     "at --stages 2, not --schedule ", f.schedule, " --stages ", f.stages);
      if (f.ep > 1 && (f.dp % f.ep != 0 || (f.schedule != "1f1b" && f.schedule != "dualpipev") || f.zero > 0))
        CUPIPE_THROW("--ep ", f.ep, " groups ", f.ep, " of the --dp replicas and runs with --schedule 1f1b or dualpipev "
                     "without --zero (",
                     f.dp % f.ep != 0 ? "--dp " + std::to_string(f.dp) + " is not a multiple of it"
                     : f.zero > 0     ? "--zero " + std::to_string(f.zero) + " was given"
                                      : "--schedule " + f.schedule + " was given",
                     ")");
    }
    if (f.plan == "auto" && (f.backend != "host" || f.preset != "tiny"))
      CUPIPE_THROW("--plan auto plans --preset tiny on the host backend");
    if (f.preset == "gpt2-124m" && f.backend != "cuda")
      CUPIPE_THROW("--preset gpt2-124m (124 M parameters, T 1024) is built for --backend cuda; on the CPU use --preset tiny");
    CUPIPE_REQUIRE(f.held_out < 1, "--held-out must be below 1, got ", f.held_out);
    CUPIPE_REQUIRE(f.batch % f.dp == 0, "--batch ", f.batch, " must divide evenly among --dp ", f.dp, " replicas");
    if (f.tp > 1 && (f.schedule != "1f1b" || (f.stages != 1 && f.stages != 2)))
      CUPIPE_THROW("--tp ", f.tp, " runs with --schedule 1f1b and --stages 1 or 2 in this trainer (the tensor-parallel "
                   "model is built for those only), not --schedule ", f.schedule, " --stages ", f.stages);
    if (f.cp > 1) {
      if (f.tp > 1 || f.pack || f.precision != "fp32" || f.backend != "host")
        CUPIPE_THROW("--cp ", f.cp, " runs on the host backend in fp32, without --tp and --pack (",
                     f.tp > 1 ? "--tp" : f.pack ? "--pack" : f.backend != "host" ? "--backend " + f.backend : "--precision " + f.precision,
                     " was given)");
      if (gpt::tiny.context % (2 * f.cp) != 0)
        CUPIPE_THROW("--cp ", f.cp, ": the tiny preset's sequences of ", gpt::tiny.context, " tokens do not cut into ",
                     2 * f.cp, " equal chunks");
    }
    const Launch& launch =
        launcher.start(argc, argv, "gpt_train", f.plan == "auto" ? 0 : f.stages, f.dp, f.timeout, f.tp,
                       comm::parse_rank_order(f.rank_order), f.cp, f.ep);
    // Ranks started with different flags fail here, at once, naming the flag (not after a timeout).
    if (launch.communicator) comm::require_same_settings(*launch.communicator, shared_settings(f));
    if (f.backend == "cuda" && launch.communicator)
      CUPIPE_THROW("--backend cuda runs in one process, stages placed with --devices; across processes the trainer "
                   "uses the host backend");
    (void)schedule::find_policy(f.schedule);  // an unknown name fails before the data loads
    cupipe::examples::require_built_schedule(f.schedule);
    // Outputs written at the end of a long run are checked now, so a bad folder fails in the first second.
    if (!f.save.empty()) {
      io::check_writable(io::model_file(f.save), "--save");
      io::check_writable(io::state_file(f.save), "--save");
    }
    if (!f.trace.empty()) io::check_writable(f.trace, "--trace");
    const index_t vocab = f.preset == "tiny" ? gpt::tiny.vocab : gpt::gpt2_124m.vocab;
    const io::TokenCorpus corpus = f.shards.empty() ? io::load_text(f.data) : io::load_llmc_shards(f.shards, vocab);
    io::TokenSplit split;
    if (f.val_shards.empty()) {
      split = io::split_held_out(corpus, f.held_out);
    } else {
      split.train = corpus.tokens;
      split.held_out = io::load_llmc_shards(f.val_shards, vocab).tokens;
    }
    if (launch.communicator)
      comm::require_same_settings(*launch.communicator, {{"training tokens", tokens_fingerprint(split.train)},
                                                         {"held-out tokens", tokens_fingerprint(split.held_out)}});
    if (f.backend == "cuda") {
#if CUPIPE_TRAINER_HAS_CUDA
      return train_cuda(f, corpus, split, launch);
#endif
    }
    // OpenBLAS's thread count is process-wide: with several workers in this process, one BLAS thread
    // each keeps them from oversubscribing the cores.
    cupipe::examples::note_blas_kernels("gpt_train", launch);
    if (!launch.communicator) backend::Host<T>::set_blas_threads(1);
    if (f.plan == "auto") {
      plan_layout(f, split.train, launch.communicator ? &launcher : nullptr);
    }
    // The training loop of --schedule's family, in fp32 or bf16: each is a unit of its own
    // (require_built_schedule let the schedule through).
    using cupipe::examples::ScheduleFamily;
    if (f.experts > 0) return train_moe(f, corpus, split, launch);
#if CUPIPE_TRAINER_HAS_FP8
    if (f.precision == "fp8-block")
      return train_family<ScheduleFamily::flush, HostFp8Block>(f, corpus, split, launch);
    if (f.precision == "fp8-delayed")
      return train_family<ScheduleFamily::flush, HostFp8Delayed>(f, corpus, split, launch);
#endif
#if CUPIPE_TRAINER_HAS_BF16
    if (f.precision == "bf16")
      return cupipe::examples::with_family(f.schedule, [&]<ScheduleFamily F>() { return train_family<F, HostBf16>(f, corpus, split, launch); });
#endif
    return cupipe::examples::with_family(f.schedule, [&]<ScheduleFamily F>() { return train_family<F>(f, corpus, split, launch); });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt_train: %s\n", e.what());
    launcher.abort_job();
    return 1;
  }
}
