// SPDX-License-Identifier: Apache-2.0
// gpt_train's training loop: one template over the model's size, the schedule, the stage count and
// the backend, instantiated by family of schedules and backend in train_*.cpp (host) and
// trainer_cuda.cu / trainer_cuda_other.cu (CUDA), which main.cpp calls.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cupipe/comm/agreement.hpp"
#include "cupipe/cp/context_group.hpp"
#include "cupipe/cupipe.hpp"
#include "cupipe/gpt/model.hpp"
#include "cupipe/pipeline/rebalance.hpp"  // stage_description
#include "launch.hpp"
#include "moe_report.hpp"
#include "step_times.hpp"
#include "trainer_schedules.hpp"

namespace gpt_trainer {

using namespace cupipe;
using examples::Launch;
using examples::parse_devices;

using T = float;

struct Flags {
  std::string data = io::fortunes_default_dir;
  std::string shards, val_shards;
  std::string preset = "tiny";
  std::string schedule = "1f1b";
  int stages = 2;
  int microbatches = 4;
  int batch = 16;
  std::int64_t steps = 2000;
  double lr = 2e-3;
  std::int64_t warmup = 100;
  double min_lr = 0.1;
  double weight_decay = 0.1;
  std::string weight_decay_on = "matrices";  ///< optim::DecayOn: "matrices" (GPT-2, nanoGPT) or "all"
  double clip = 1.0;
  std::uint64_t seed = 0;
  std::string data_order = "shuffled";  ///< io::WindowOrder of the training windows: "shuffled" or "in-order"
  std::int64_t eval_every = 100;
  int eval_batches = 8;
  double held_out = 0.05;
  int sample = 200;
  std::string prompt = "The ";
  double temperature = 0.8;
  int sample_top_k = 40;  ///< --sample-top-k: sample among the k likeliest tokens
  int experts = 0;        ///< --experts: 0 dense; E, every second block's MLP a mixture of E experts
  int expert_top_k = 2;   ///< --top-k: experts per token
  double capacity = 0;    ///< --capacity: an expert's capacity factor per sequence; 0 dropless
  std::string save, resume, trace;
  std::int64_t save_every = 0;
  double max_seconds = 0;
  std::int64_t max_steps = 0;
  std::string progress = "auto";
  std::string backend = "host";
  std::string devices;
  std::string math = "tf32";
  std::string precision = "fp32";  ///< "bf16": Host<bfloat16, float> or Cuda<bfloat16, float>; "fp8-block",
                                   ///< "fp8-delayed": backend::HostFp8
  int dp = 1;
  double timeout = comm::Communicator::default_collective_timeout_seconds;
  std::string plan;                   ///< "auto": the planner chooses the schedule, stages and microbatches
  int workers = 0;                    ///< devices the planner may use with --plan auto; 0: the cores, at most 4
  double predicted_step_seconds = 0;  ///< the planned layout's, set by --plan auto
  std::vector<double> predicted_activation_bytes{};  ///< the planned layout's, per stage (one rank's part)
  std::vector<StateBytes> predicted_state_bytes{};   ///< the planned layout's parameter state between steps, per stage
  /// The least and most activation peak any timing can give, per stage (Layout's bounds).
  std::vector<double> predicted_activation_low_bytes{}, predicted_activation_high_bytes{};
  int post_validation = 0;            ///< steps per Pipeline::train_steps call with post-validation; 0: off
  int check_equivalence = 0;          ///< the first N steps also run unpipelined and must agree; 0: off
  std::string hand_over = "full";     ///< --hand-over: full, bf16 or e4m3, for every link or one per link
  int zero = 0;  ///< the ZeRO stage: 1, the AdamW state sharded over the --dp replicas; 2, the gradients too; 3, the weights too
  int tp = 1;                         ///< tensor-parallel ranks per stage (Megatron's split of each block)
  int cp = 1;                         ///< context-parallel ranks per ring (each sequence split over them)
  int ep = 1;                         ///< expert-parallel ranks per group (each holding experts / ep of every MoE block's)
  bool paired_turns = false;          ///< --paired-turns: DualPipeV's overlapped pairs take turns at the all-to-alls
  std::vector<int> plan_tensor{1, 2, 4};  ///< tensor-parallel degrees --plan auto may choose under mpirun
  bool plan_tensor_given = false;         ///< --plan-tensor was on the command line
  std::vector<int> plan_context{1, 2, 4};  ///< context-parallel ring sizes --plan auto may choose under mpirun
  bool plan_context_given = false;         ///< --plan-context was on the command line
  std::vector<int> plan_ep;                ///< expert-parallel group sizes --plan auto --experts weighs (--plan-ep; empty: not given)
  bool zero_given = false;                ///< --zero was on the command line (--plan auto then keeps it)
  std::string rank_order = "stages-outermost";  ///< comm::RankOrder of the ranks
  bool pack = false;  ///< --pack: packed sequences, a document beginning at each separator token
  /// --pack-separator: the token that begins a document; -1: <|endoftext|> (50256) for llm.c shards,
  /// '%' (fortune's line between two texts) for byte-level text.
  std::int32_t pack_separator = -1;
};

/// The token --pack starts a document at: --pack-separator, else llm.c's <|endoftext|> in token
/// shards (it begins every document) or '%' in byte-level text (fortune files put it on a line of
/// its own between two texts).
inline std::int32_t pack_separator(const Flags& f) {
  if (f.pack_separator >= 0) return f.pack_separator;
  return f.shards.empty() ? std::int32_t('%') : 50256;
}

/// Degrees as a flag lists them: "1,2,4,".
inline std::string degree_list(const std::vector<int>& degrees) {
  std::string out;
  for (const int d : degrees) out += std::to_string(d) + ",";
  return out;
}

/// The flags every rank of a multi-process run must share (display flags and the data paths, which
/// may be mounted elsewhere on another node, are left out; the tokens are compared after loading).
inline comm::Settings shared_settings(const Flags& f) {
  const auto real = examples::exact_text;
  return {{"--preset", f.preset},       {"--schedule", f.schedule},
          {"--stages", std::to_string(f.stages)}, {"--dp", std::to_string(f.dp)},
          {"--microbatches", std::to_string(f.microbatches)}, {"--batch", std::to_string(f.batch)},
          {"--steps", std::to_string(f.steps)}, {"--lr", real(f.lr)},
          {"--warmup", std::to_string(f.warmup)}, {"--min-lr", real(f.min_lr)},
          {"--weight-decay", real(f.weight_decay)}, {"--weight-decay-on", f.weight_decay_on},
          {"--clip", real(f.clip)},             {"--data-order", f.data_order},
          {"--seed", std::to_string(f.seed)},   {"--held-out", real(f.held_out)},
          {"--eval-every", std::to_string(f.eval_every)}, {"--eval-batches", std::to_string(f.eval_batches)},
          {"--save", f.save},                   {"--save-every", std::to_string(f.save_every)},
          {"--resume", f.resume},               {"--max-steps", std::to_string(f.max_steps)},
          {"--max-seconds", real(f.max_seconds)}, {"--backend", f.backend},
          {"--sample", std::to_string(f.sample)}, {"--prompt", f.prompt},
          {"--zero", std::to_string(f.zero)}, {"--tp", std::to_string(f.tp)}, {"--cp", std::to_string(f.cp)}, {"--ep", std::to_string(f.ep)}, {"--rank-order", f.rank_order},
          {"--precision", f.precision},         {"--plan", f.plan},
          {"--pack", f.pack ? std::to_string(pack_separator(f)) : "off"},
          {"--experts", std::to_string(f.experts)}, {"--top-k", std::to_string(f.expert_top_k)}, {"--capacity", real(f.capacity)},
          {"--plan-tensor", degree_list(f.plan_tensor)}, {"--plan-context", degree_list(f.plan_context)},
          {"--plan-ep", f.plan_ep.empty() ? "off" : degree_list(f.plan_ep)}};
}

/// FNV-1a over a token stream: equal on every rank that loaded the same corpus.
inline std::string tokens_fingerprint(const std::vector<std::int32_t>& tokens) {
  Fnv1a hash;
  hash.add(tokens.data(), tokens.size() * sizeof(std::int32_t));
  char text[48];
  std::snprintf(text, sizeof text, "%zu tokens, hash %016llx", tokens.size(), (unsigned long long)hash.value());
  return text;
}

/// A pipeline seen through nanoGPT's parameter names: what save_checkpoint and load_checkpoint read
/// and write, so a nanoGPT GPT module loads the model file with load_state_dict.
template <gpt::Config config, class Pipe>
struct NanoGptNames {
  using T = typename Pipe::G;  // master weights and optimizer state: fp32 in a bf16 run too
  Pipe& pipe;
  std::vector<ParamInfo> parameter_table() const {
    std::vector<ParamInfo> table = Pipe::parameter_table();
    for (ParamInfo& p : table) p.name = gpt::nanogpt_name(config, p.name);
    return table;
  }
  std::vector<T> parameters() { return pipe.parameters(); }
  std::vector<T> optimizer_state(std::size_t slot) { return pipe.optimizer_state(slot); }
  bool writes_checkpoints() const { return pipe.writes_checkpoints(); }
  void set_parameters(std::span<const T> values) { pipe.set_parameters(values); }
  template <class Optimizer>
  void set_optimizer_state(const Optimizer& o, std::size_t slot, std::span<const T> values, std::int64_t updates) {
    pipe.set_optimizer_state(o, slot, values, updates);
  }
};

/// A logit as a double: float, double or bfloat16 (which converts through float).
template <class V>
double widen(V v) {
  return pipeline::convert_value<double>(v);
}

/// Mean cross-entropy (nats per token) of the model on `batches` fixed batches of held-out windows:
/// the same every run (seed 0's order, whatever --seed), drawn from all of the held-out part. Logits
/// are computed a few sequences at a time, at most ~64 M values (256 MiB) in host memory: a GPT-2
/// vocabulary makes a whole batch's logits gigabytes. With a `separator` (>= 0: --pack), documents
/// begin at that token, as in training. With a context-parallel `ring` (--cp) each rank predicts its
/// share of every window's tokens, and the ring sums the shares.
template <gpt::Config config, class Pipe>
double held_out_loss(Pipe& pipe, const std::vector<std::int32_t>& tokens, int batch, int batches, std::int32_t separator = -1,
                     cp::ContextGroup* ring = nullptr) {
  const index_t V = config.vocab, Tn = config.context;
  const index_t chunk = std::clamp<index_t>((index_t(1) << 26) / (Tn * V), 1, batch);
  io::WindowLoader loader(tokens, Tn, batch, 0, 1, io::WindowPosition::start(0), io::WindowOrder::shuffled);
  std::vector<std::int32_t> x, y;
  std::vector<typename Pipe::T> logits;  // the last stage's storage precision
  double total = 0;
  std::int64_t count = 0;
  for (int b = 0; b < batches; ++b) {
    loader.next(x, y);
    for (index_t first = 0; first < batch; first += chunk) {
      index_t rows = std::min<index_t>(chunk, batch - first) * Tn;
      std::span<const std::int32_t> ids(x.data() + first * Tn, std::size_t(rows)), labels(y.data() + first * Tn, std::size_t(rows));
      std::vector<std::int32_t> my_ids, my_labels;  // with a ring: this rank's share
      if (ring) {
        my_ids = cp::local_rows(ids, Tn, ring->rank(), ring->size());
        my_labels = cp::local_rows(labels, Tn, ring->rank(), ring->size());
        ids = my_ids;
        labels = my_labels;
        rows /= ring->size();
      }
      logits.resize(std::size_t(rows * V));
      const std::vector<std::int32_t> starts = separator >= 0 ? document_starts(ids, Tn, separator) : std::vector<std::int32_t>{};
      pipe.predict(ConstView<std::int32_t>{ids.data(), Shape{rows, 1}}, TensorView<typename Pipe::T>{logits.data(), Shape{rows, V}},
                   separator >= 0 ? DocumentStarts{starts.data(), rows} : DocumentStarts{});
      for (index_t r = 0; r < rows; ++r) {
        const auto* z = logits.data() + r * V;
        double max = widen(z[0]);
        for (index_t v = 1; v < V; ++v) max = std::max(max, widen(z[v]));
        double sum = 0;
        for (index_t v = 0; v < V; ++v) sum += std::exp(widen(z[v]) - max);
        total += max + std::log(sum) - widen(z[labels[std::size_t(r)]]);
        ++count;
      }
    }
  }
  if (ring) {
    double shares[2] = {total, double(count)};
    ring->sum(shares, 2);
    return shares[0] / shares[1];
  }
  return total / double(count);
}

/// Entropy (nats) of the tokens' frequencies: the loss of the best model that ignores context.
inline double unigram_entropy(const std::vector<std::int32_t>& tokens, index_t vocab) {
  std::vector<double> counts(std::size_t(vocab), 0.0);
  for (std::int32_t t : tokens) counts[std::size_t(t)] += 1;
  double h = 0;
  for (double c : counts)
    if (c > 0) h -= c / double(tokens.size()) * std::log(c / double(tokens.size()));
  return h;
}

/// Draws `count` tokens after `prompt`: each step runs the last T tokens (right-padded: causal
/// attention never looks ahead) and samples the next from the logits at the last real position, with
/// temperature and top-k. With a context-parallel `ring` (--cp) each rank predicts its share of the
/// window; the rank that holds the last real position shares its logits round the ring (a sum with
/// the others' zeros), and every rank draws the same token from the same stream.
template <gpt::Config config, class Pipe>
std::vector<std::int32_t> generate(Pipe& pipe, std::vector<std::int32_t> text, int count, double temperature, int top_k,
                                   Rng& rng, cp::ContextGroup* ring = nullptr) {
  const index_t Tn = config.context, V = config.vocab;
  const int cp = ring ? ring->size() : 1, rank = ring ? ring->rank() : 0;
  std::vector<std::int32_t> window(static_cast<std::size_t>(Tn));
  std::vector<typename Pipe::T> logits(std::size_t(Tn / cp * V));
  std::vector<double> row(static_cast<std::size_t>(V));
  std::vector<std::pair<double, std::int32_t>> ranked(static_cast<std::size_t>(V));
  for (int i = 0; i < count; ++i) {
    const std::size_t used = std::min<std::size_t>(text.size(), std::size_t(Tn));
    std::fill(window.begin(), window.end(), 0);
    std::copy(text.end() - std::ptrdiff_t(used), text.end(), window.begin());
    const std::vector<std::int32_t> mine = cp::local_rows(std::span<const std::int32_t>(window), Tn, rank, cp);
    pipe.predict(ConstView<std::int32_t>{mine.data(), Shape{Tn / cp, 1}},
                 TensorView<typename Pipe::T>{logits.data(), Shape{Tn / cp, V}});
    std::fill(row.begin(), row.end(), 0.0);
    const index_t last = index_t(used) - 1;
    if (const index_t local = cp::local_row_of(last, Tn, rank, cp); local >= 0)
      for (index_t v = 0; v < V; ++v) row[std::size_t(v)] = widen(logits[std::size_t(local * V + v)]);
    if (ring) ring->sum(row.data(), row.size());
    for (index_t v = 0; v < V; ++v) ranked[std::size_t(v)] = {row[std::size_t(v)] / temperature, std::int32_t(v)};
    const int k = top_k > 0 ? std::min<int>(top_k, int(V)) : int(V);
    std::partial_sort(ranked.begin(), ranked.begin() + k, ranked.end(), [](auto& a, auto& b) { return a.first > b.first; });
    double sum = 0;
    for (int j = 0; j < k; ++j) sum += std::exp(ranked[std::size_t(j)].first - ranked[0].first);
    double u = rng.uniform() * sum;
    std::int32_t next = ranked[std::size_t(k - 1)].second;
    for (int j = 0; j < k; ++j) {
      u -= std::exp(ranked[std::size_t(j)].first - ranked[0].first);
      if (u <= 0) {
        next = ranked[std::size_t(j)].second;
        break;
      }
    }
    text.push_back(next);
  }
  return text;
}

/// Bytes as text for a terminal: control bytes other than newline and tab shown as '?'. Token ids
/// above 255 (llm.c shards) are shown as <id>.
inline std::string printable(const std::vector<std::int32_t>& tokens) {
  std::string out;
  for (std::int32_t t : tokens) {
    if (t > 255) out += "<" + std::to_string(t) + ">";
    else out += (t == '\n' || t == '\t' || t >= 32) && t != 127 ? char(t) : '?';
  }
  return out;
}

/// What the device build adds to a step's line: the achieved model TFLOP/s against the GPUs' GEMM
/// rate measured at start (0: the host backend, where MFU is not reported).
struct DeviceRate {
  double peak_tflops = 0;  ///< the sum over the GPUs the stages use
  std::string math;        ///< "fp32", "tf32" or "bf16": the GEMMs' mode, in which the peak was measured
};

/// Leaves a new pipeline as it is (the host build); the device build sets the GEMMs' math mode.
struct AsBuilt {
  template <class Pipe>
  void operator()(Pipe&) const {}
};

inline std::string mebibytes(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MiB", bytes / (1024.0 * 1024.0));
  return text;
}

/// The model one rank trains: its tensor-parallel part with TP > 1, its expert-parallel part with
/// EP > 1, else the whole model.
template <gpt::Config config, int TP, int EP>
struct RankModel {
  using type = gpt::TensorParallelModel<config, TP>;  // gpt::Model<config> itself with TP 1
};
template <gpt::Config config, int EP>
  requires(EP > 1)
struct RankModel<config, 1, EP> {
  using type = gpt::ExpertParallelModel<config, EP>;
};

template <gpt::Config config, class Schedule, int P, class Backend, int TP = 1, class Configure = AsBuilt, int EP = 1>
int train(const Flags& f, const io::TokenCorpus& corpus, const io::TokenSplit& split, const Launch& launch,
          const DeviceRate& rate = {}, Configure configure = {}) {
  using Model = typename RankModel<config, TP, EP>::type;
  using Stages = partition_for<Model, P, Schedule>;
  using Pipe = Pipeline<Stages, Schedule, Backend>;
  CUPIPE_REQUIRE(!f.pack || pack_separator(f) < config.vocab, "--pack-separator ", pack_separator(f),
                 " is not a token of the ", f.preset, " vocabulary (0 to ", config.vocab - 1, ")");
  Pipe pipe({.microbatches = f.microbatches, .seed = f.seed, .devices = parse_devices(f.devices), .packed_sequences = f.pack,
             .transfer_timeout_seconds = f.timeout, .communicator = launch.communicator,
             .post_validation = f.post_validation > 0, .zero = f.zero, .check_equivalence = f.check_equivalence,
             .hand_over = parse_wires(f.hand_over), .paired_turns = f.paired_turns});
  // With --tp or --ep each rank draws its part of the whole model's initialisation (LayerSeq::init),
  // so such a run starts where the same run without it does.
  configure(pipe);
  MoeReport<config, P> moe_report(pipe, launch.communicator.get());
  NanoGptNames<config, Pipe> named{pipe};
  optim::AdamW adamw({.lr = f.lr, .weight_decay = f.weight_decay, .clip_norm = f.clip,
                      .schedule = {f.warmup, f.steps, f.min_lr},
                      .decay_on = f.weight_decay_on == "all" ? optim::DecayOn::all : optim::DecayOn::matrices});
  // Only the first rank talks; every rank computes.
  auto say = [&](const char* format, auto... args) {
    if (launch.leader()) std::printf(format, args...);
  };

  const bool bytes = f.shards.empty();
  say("cupipe %s: GPT %s (V %lld, T %lld, %lld blocks, %lld heads, C %lld; %.2f M parameters, lm_head %s), backend %s\n",
      version_string, f.preset.c_str(), (long long)config.vocab, (long long)config.context, (long long)config.layers,
      (long long)config.heads, (long long)config.channels, double(config.unique_parameters()) / 1e6,
      config.tied ? "tied to wte" : "untied", f.backend.c_str());
  if constexpr (!std::is_same_v<typename Pipe::T, typename Pipe::G>)
    say("precision: weights in use, activations and messages in bf16; master weights, gradients, AdamW state and the "
        "loss in fp32\n");
  if constexpr (requires { typename Backend::recipe; })
    say("FP8 (%s, emulated on the CPU): every GEMM of a layer multiplies FP8 codes with fp32 accumulation, %s\n",
        std::string(Backend::name).c_str(),
        std::is_same_v<typename Backend::recipe, fp8::Blockwise>
            ? "E4M3 in 1 x 128 activation tiles and 128 x 128 weight blocks (DeepSeek-V3)"
            : "one scale per tensor from its last 16 amaxes, E4M3 forward and E5M2 gradients (TransformerEngine)");
  moe_report.describe(say);
  say("%s: %lld files, %zu tokens; %zu train, %zu held out\n", corpus.source.c_str(), (long long)corpus.files,
      corpus.tokens.size(), split.train.size(), split.held_out.size());
  say("%s, %d stages x %d chunk(s)%s%s; %d sequences (%d tokens) a step in %d microbatches; AdamW lr %g\n",
      std::string(Schedule::name).c_str(), P, Schedule::chunks,
      (launch.replicas > 1 ? " x " + std::to_string(launch.replicas) + " replicas" : std::string()).c_str(),
      (TP > 1 ? " x " + std::to_string(TP) + " tensor-parallel ranks" : launch.context > 1 ? " x " + std::to_string(launch.context) + " context-parallel ranks" : std::string()).c_str(), f.batch,
      f.batch * int(config.context), f.microbatches, f.lr);
  if (launch.communicator) say("%s\n", launch.communicator->topology().describe().c_str());
  if (f.pack) {
    const auto found = std::count(split.train.begin(), split.train.end(), pack_separator(f));
    CUPIPE_REQUIRE(found > 0, "--pack: the training tokens hold no separator ", pack_separator(f),
                   ", so every window would be one document; give --pack-separator");
    say("packed sequences: a document begins at each token %d (%lld of them in the training tokens, one per %.0f tokens); "
        "attention stays within a document, positions restart at its start\n",
        int(pack_separator(f)), (long long)found, double(split.train.size()) / double(found));
  }
  // What each worker will hold, before anything is allocated (one-chunk schedules): the first stage
  // of 1F1B holds the most microbatches, the last the head's V-wide output.
  std::array<double, Stages::size> estimate{};
  if constexpr (Schedule::chunks == 1) {
    const int sequences = (f.batch / launch.replicas + f.microbatches - 1) / f.microbatches;
    estimate = estimated_stage_bytes<Stages, Schedule>(
        f.microbatches, memory_model_for<Backend>(index_t(sequences) * config.context / launch.context));
  }
  for (int k = 0; k < int(Stages::size); ++k)
    say("  stage %d: %s%s\n", k, stage_description<Stages>(k).c_str(),
        estimate[std::size_t(k)] > 0 ? (", estimated " + mebibytes(estimate[std::size_t(k)])).c_str() : "");
  if (rate.peak_tflops > 0)
    say("measured %s GEMM rate of the GPUs in use: %.1f TFLOP/s (the MFU denominator); %.3g model FLOPs per token\n",
        rate.math.c_str(), rate.peak_tflops, config.flops_per_token());
  const double unigram = unigram_entropy(split.train, config.vocab);
  const double per_bit = bytes ? std::log(2.0) : 1.0;  // bits per byte for text; nats per token for shards
  const char* unit = bytes ? "bits per byte" : "nats per token";
  say("unigram baseline (no context): %.4f nats = %.4f %s\n", unigram, unigram / per_bit, unit);

  // The training windows' order: --seed's permutation each epoch, or the corpus's order.
  io::TrainingState state;
  io::WindowPosition data_start = io::WindowPosition::start(f.seed);
  if (!f.resume.empty()) {
    state = io::load_checkpoint(f.resume, named, adamw);
    const auto order = state.extra.find("data_order");
    if (order == state.extra.end())
      CUPIPE_THROW("--resume ", f.resume, ": the checkpoint keeps no data order (written before gpt_train shuffled "
                   "its windows, its data position counts windows in corpus order); start a new run");
    if (order->second != f.data_order)
      CUPIPE_THROW("--resume ", f.resume, ": the checkpoint's windows came in --data-order ", order->second,
                   ", this run's in ", f.data_order);
    data_start = {state.rng, state.epoch, state.batch};
    say("resumed from %s: %lld updates, data position: epoch %lld, batch %lld\n", f.resume.c_str(),
        (long long)state.updates, (long long)state.epoch, (long long)state.batch);
  }
  // --batch sequences a step in all: each replica reads its own batch / dp of them; with --cp each
  // rank of a context-parallel ring keeps its two zigzag chunks of every sequence.
  cp::ContextGroup* ring = launch.communicator ? launch.communicator->context_group() : nullptr;
  io::WindowLoader loader(split.train, config.context, f.batch / launch.replicas, launch.replica, launch.replicas,
                          data_start, f.data_order == "in-order" ? io::WindowOrder::in_order : io::WindowOrder::shuffled);
  auto save = [&] {
    state.updates = pipe.updates();
    state.rng = loader.position().rng;
    state.epoch = loader.position().epoch;
    state.batch = loader.position().batch;
    state.extra = {{"preset", f.preset}, {"schedule", std::string(Schedule::name)}, {"stages", std::to_string(P)},
                   {"data_order", f.data_order}};
    io::save_checkpoint(f.save, named, adamw, state);
    say("saved %s (nanoGPT names) and %s\n", io::model_file(f.save).c_str(), io::state_file(f.save).c_str());
  };

  const bool bar = launch.leader() && (f.progress == "bar" || (f.progress == "auto" && isatty(STDOUT_FILENO)));
  const bool quiet = f.progress == "none" || !launch.leader();
  nlohmann::json curve = nlohmann::json::array();
  std::int64_t rollbacks = 0;
  double seconds = 0, last_loss = 0, eval_loss = 0, bubble_sum = 0, achieved_sum = 0;
  std::int64_t steps = 0;
  StepStats last_stats;
  std::vector<double> step_times;  // wall time of every train_step
  const auto start = std::chrono::steady_clock::now();
  auto evaluate = [&](std::int64_t step) {
    eval_loss = held_out_loss<config>(pipe, split.held_out, f.batch, f.eval_batches, f.pack ? pack_separator(f) : -1, ring);
    if (bar) std::printf("\n");
    say("step %lld: held-out loss %.4f (%.4f %s), train loss %.4f, %.1f s\n", (long long)step, eval_loss,
        eval_loss / per_bit, unit, last_loss, seconds);
    curve.push_back({{"step", step}, {"seconds", seconds}, {"train_loss", last_loss}, {"held_out_loss", eval_loss}});
    std::fflush(stdout);
  };
  // With --post-validation N, up to N steps go to one train_steps call (no flush between them). A
  // group ends where an evaluation, a save or the run does, so those always follow a whole step.
  const std::int64_t window = std::max(1, f.post_validation);
  std::vector<std::vector<std::int32_t>> xs(static_cast<std::size_t>(window)), ys(static_cast<std::size_t>(window));
  std::vector<std::vector<std::int32_t>> starts(static_cast<std::size_t>(window));  // --pack: each batch's borders
  std::vector<typename Pipe::Batch> group;
  moe_report.start(pipe.updates());
  for (std::int64_t first_step = pipe.updates(); first_step < f.steps;) {
    std::int64_t count = std::min<std::int64_t>(window, f.steps - first_step);
    if (f.max_steps > 0) count = std::min<std::int64_t>(count, std::max<std::int64_t>(1, f.max_steps - first_step));
    if (f.eval_every > 0) count = std::min<std::int64_t>(count, f.eval_every - first_step % f.eval_every);
    if (!f.save.empty() && f.save_every > 0) count = std::min<std::int64_t>(count, f.save_every - first_step % f.save_every);
    group.clear();
    for (std::int64_t k = 0; k < count; ++k) {
      std::vector<std::int32_t>& x = xs[std::size_t(k)];
      std::vector<std::int32_t>& y = ys[std::size_t(k)];
      loader.next(x, y);
      if (ring) {
        x = cp::local_rows(std::span<const std::int32_t>(x), config.context, ring->rank(), ring->size());
        y = cp::local_rows(std::span<const std::int32_t>(y), config.context, ring->rank(), ring->size());
      }
      const index_t rows = index_t(x.size());
      DocumentStarts documents{};
      if (f.pack) {
        starts[std::size_t(k)] = document_starts(x, config.context, pack_separator(f));
        documents = {starts[std::size_t(k)].data(), rows};
      }
      group.push_back({ConstView<std::int32_t>{x.data(), Shape{rows, 1}}, ConstView<std::int32_t>{y.data(), Shape{rows}}, documents});
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<StepStats> results;
    if (count == 1) results.push_back(pipe.train_step(group[0].x, group[0].labels, adamw, group[0].documents));
    else results = pipe.train_steps(std::span<const typename Pipe::Batch>(group), adamw);
    // Overlapped steps have no boundaries of their own: each gets the group's mean.
    const double step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / double(count);
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (std::int64_t step = first_step; step < first_step + count; ++step) {
      last_stats = results[std::size_t(step - first_step)];
      rollbacks += last_stats.rolled_back ? 1 : 0;
      step_times.push_back(step_seconds);
      last_loss = last_stats.loss;
      bubble_sum += last_stats.bubble_fraction;
      ++steps;
      // Tokens of the whole step (every replica's); the model FLOPs they took, per second.
      const double tokens_per_second = double(f.batch) * double(config.context) / step_seconds;
      const double achieved = tokens_per_second * config.flops_per_token() / 1e12;
      achieved_sum += achieved;
      if (!quiet) {
        char device_rate[96] = "";
        if (rate.peak_tflops > 0)
          std::snprintf(device_rate, sizeof device_rate, ", %.2f TFLOP/s, MFU %.1f%%", achieved,
                        100 * achieved / rate.peak_tflops);
        if (bar)
          std::printf("\rstep %lld/%lld  loss %.4f  lr %.2e  |g| %.3f  %.0f tokens/s%s ", (long long)step + 1, (long long)f.steps,
                      last_stats.loss, adamw.lr(step), last_stats.grad_norm, tokens_per_second, device_rate);
        else if ((step + 1) % 10 == 0 || step == 0)
          std::printf("step %lld/%lld: loss %.4f, lr %.2e, grad norm %.3f, %.0f tokens/s%s\n", (long long)step + 1,
                      (long long)f.steps, last_stats.loss, adamw.lr(step), last_stats.grad_norm, tokens_per_second, device_rate);
        std::fflush(stdout);
      }
      // Every rank sums the experts' tallies at the same steps (a collective); the leader prints.
      if ((step + 1) % 10 == 0 || step == 0) moe_report.interval(step + 1, say, !quiet && !bar);
    }
    first_step += count;
    const std::int64_t step = first_step - 1;  // the group's last
    const bool last = step + 1 == f.steps || (f.max_steps > 0 && step + 1 >= f.max_steps) ||
                      (f.max_seconds > 0 && seconds >= f.max_seconds);
    if (f.eval_every > 0 && ((step + 1) % f.eval_every == 0 || last)) evaluate(step + 1);
    if (!f.save.empty() && (last || (f.save_every > 0 && (step + 1) % f.save_every == 0))) save();
    if (last) break;
  }
  if (bar) std::printf("\n");
  // Measured: each local worker's peak bytes (weights, gradients, AdamW, activations), by its allocator.
  // Per worker (P of them): a two-chunk schedule's Stages has 2P virtual stages.
  nlohmann::json peak_bytes = nlohmann::json::array();
  for (int w = 0; w < P; ++w)
    if (pipe.local(w)) {
      const double peak = double(pipe.backend(w).memory.peak());
      peak_bytes.push_back(peak);
      if (steps && !quiet)
        std::printf("stage %d: peak %s%s\n", w, mebibytes(peak).c_str(),
                    estimate[std::size_t(w)] > 0 ? (" (estimated " + mebibytes(estimate[std::size_t(w)]) + ")").c_str() : "");
    }
  if (steps == 0 || f.eval_every == 0) evaluate(pipe.updates());
  if (!f.trace.empty() && steps && launch.leader()) {
    io::write_file_atomically(f.trace, measured_trace_json(pipe.plan(), last_stats));
    std::printf("wrote %s (open it in https://ui.perfetto.dev or chrome://tracing): the last step, measured and "
                "simulated side by side\n", f.trace.c_str());
  }

  std::string sample;
  if (f.sample > 0) {
    Rng rng(f.seed + 1);
    const std::vector<std::int32_t> prompt(f.prompt.begin(), f.prompt.end());
    sample = printable(generate<config>(pipe, prompt, f.sample, f.temperature, f.sample_top_k, rng, ring));
    say("--- sample (temperature %g, top-k %d) ---\n%s\n---\n", f.temperature, f.sample_top_k, sample.c_str());
  }
  const double median_step = examples::median_step_seconds(step_times);
  if (f.predicted_step_seconds > 0 && median_step > 0)
    say("planned layout: step %.2f ms predicted, %.2f ms measured (median of %zu steps), %+.1f%%\n",
        f.predicted_step_seconds * 1e3, median_step * 1e3, step_times.size(), 100 * (f.predicted_step_seconds / median_step - 1));
  // Each local stage's activation peak in the last step (its allocator's), beside the plan's; every
  // rank prints its own (a tensor-parallel rank holds its part).
  if (f.predicted_step_seconds > 0 && steps)
    for (int w = 0; w < P; ++w) {
      const std::size_t k = std::size_t(w);
      if (!pipe.local(w) || k >= f.predicted_activation_bytes.size() || k >= last_stats.peak_activation_bytes.size()) continue;
      const double predicted = f.predicted_activation_bytes[k], measured = double(last_stats.peak_activation_bytes[k]);
      std::string bounds;
      // The bounds are one step's; --post-validation overlaps adjacent steps' actions.
      if (f.post_validation == 0 && k < f.predicted_activation_low_bytes.size() && k < f.predicted_activation_high_bytes.size()) {
        const double low = f.predicted_activation_low_bytes[k], high = f.predicted_activation_high_bytes[k];
        char text[128];
        std::snprintf(text, sizeof text, " (any timing: %.1f to %.1f KiB, %s)", low / 1024, high / 1024,
                      measured >= low && measured <= high ? "within" : "OUTSIDE: the replay's accounting is wrong");
        bounds = text;
      }
      std::printf("planned layout, stage %d%s: activation peak %.1f KiB predicted, %.1f KiB measured, %+.1f%%%s\n", w,
                  launch.communicator ? (" (rank " + std::to_string(launch.rank) + ")").c_str() : "", predicted / 1024,
                  measured / 1024, measured > 0 ? 100 * (predicted / measured - 1) : 0.0, bounds.c_str());
    }
  // The AdamW state, gradients and weights this rank holds between steps (with --zero, its shards of
  // its stages' AdamW state; with --zero=2, of their summed gradients too; with --zero=3, of their
  // weights too).
  std::int64_t optimizer_bytes = 0, gradient_bytes = 0, weight_bytes = 0;
  for (int w = 0; w < P; ++w)
    if (pipe.local(w)) {
      optimizer_bytes += pipe.backend(w).memory.in_use(MemoryTag::optimizer);
      gradient_bytes += pipe.backend(w).memory.in_use(MemoryTag::gradients);
      weight_bytes += pipe.backend(w).memory.in_use(MemoryTag::weights);
    }
  if (f.zero)
    say("ZeRO-%d: this rank keeps %.2f MiB of AdamW state, %.2f MiB of gradients and %.2f MiB of weights between steps\n",
        f.zero, double(optimizer_bytes) / 1048576.0, double(gradient_bytes) / 1048576.0, double(weight_bytes) / 1048576.0);
  // The plan's parameter state between steps beside the allocator's, each rank its own stages.
  for (int w = 0; w < P; ++w)
    if (pipe.local(w) && std::size_t(w) < f.predicted_state_bytes.size()) {
      const StateBytes& planned = f.predicted_state_bytes[std::size_t(w)];
      const MemoryTracker& m = pipe.backend(w).memory;
      const double measured =
          double(m.in_use(MemoryTag::weights) + m.in_use(MemoryTag::gradients) + m.in_use(MemoryTag::optimizer));
      // A shard is ceil(n / replicas) of each stage's n values, the plan's n / replicas.
      const bool close = std::abs(planned.total() - measured) <= 0.01 * measured;
      std::printf("planned layout, stage %d%s: parameter state between steps (ZeRO-%d) %.1f KiB predicted, %.1f KiB "
                  "measured, %s (weights %.1f / %.1f, gradients %.1f / %.1f, optimizer %.1f / %.1f)\n",
                  w, launch.communicator ? (" (rank " + std::to_string(launch.rank) + ")").c_str() : "", f.zero,
                  planned.total() / 1024, measured / 1024, close ? "within 1%" : "MORE THAN 1% OFF",
                  planned.weights / 1024, double(m.in_use(MemoryTag::weights)) / 1024, planned.gradients / 1024,
                  double(m.in_use(MemoryTag::gradients)) / 1024, planned.optimizer / 1024, double(m.in_use(MemoryTag::optimizer)) / 1024);
    }
  nlohmann::json summary = {{"held_out_loss", eval_loss},
                            {"held_out_bits_per_byte", bytes ? eval_loss / per_bit : 0.0},
                            {"unigram_loss", unigram},
                            {"train_loss", last_loss},
                            {"steps", pipe.updates()},
                            {"seconds", seconds},
                            {"tokens_per_second", seconds > 0 ? double(steps * f.batch * config.context) / seconds : 0.0},
                            {"bubble_fraction_measured", steps ? bubble_sum / double(steps) : 0.0},
                            // The last step's hand-overs from this process's workers to others, as
                            // their transports moved them (packed where --hand-over compresses).
                            {"sent_bytes_per_step", std::accumulate(last_stats.sent_bytes.begin(), last_stats.sent_bytes.end(), std::int64_t{0})},
                            {"backend", f.backend},
                            {"precision", f.precision},
                            {"packed", f.pack},
                            {"schedule", f.schedule},
                            {"stages", f.stages},
                            {"data_parallel", launch.replicas},
                            {"tensor_parallel", TP},
                            {"context_parallel", launch.context},
                            {"microbatches", f.microbatches},
                            {"peak_bytes_measured", peak_bytes},
                            {"optimizer_bytes", optimizer_bytes},
                            {"gradient_bytes", gradient_bytes},
                            {"weight_bytes", weight_bytes},
                            {"step_seconds_measured", median_step},
                            {"curve", curve}};
  if (config.experts > 0) summary["moe"] = moe_report.summary();
  if (f.predicted_step_seconds > 0) summary["step_seconds_predicted"] = f.predicted_step_seconds;
  if (f.post_validation > 0) summary["post_validation_rollbacks"] = rollbacks;
  if (rate.peak_tflops > 0 && steps) {
    summary["achieved_tflops"] = achieved_sum / double(steps);
    summary["peak_tflops_measured"] = rate.peak_tflops;
    summary["mfu"] = achieved_sum / double(steps) / rate.peak_tflops;
  }
  say("%s\n", summary.dump().c_str());
  return 0;
}

/// The GPUs the stages use (--devices, or device 0 for all), each once.
inline std::vector<int> devices_in_use(const Flags& f) {
  const std::vector<int> listed = parse_devices(f.devices);
  const std::set<int> distinct(listed.begin(), listed.end());
  return distinct.empty() ? std::vector<int>{0} : std::vector<int>(distinct.begin(), distinct.end());
}

/// Trains `config` (the tiny preset on the host) on `Backend` (backend::Host<float>; Host<bfloat16,
/// float> for --precision bf16; backend::Cuda<float> or Cuda<bfloat16, float> with --backend cuda,
/// `configure` setting up each pipeline's contexts) with a --schedule of family F: one-chunk schedules
/// at 1, 2 and 4 stages, two-chunk ones at 1 and 2; on the host also --tp 2 or 4 with 1F1B on 1 or 2
/// stages. Each family, precision and backend is instantiated outside main.cpp (train_flush.cpp and
/// train_other.cpp; train_bf16.cpp and train_bf16_other.cpp for bf16; trainer_cuda.cu and
/// trainer_cuda_other.cu on CUDA), so that they compile side by side; main.cpp calls the one of
/// --schedule's family.
template <examples::ScheduleFamily F, class Backend = backend::Host<T>, gpt::Config config = gpt::tiny,
          class Configure = AsBuilt>
int train_family(const Flags& f, const io::TokenCorpus& corpus, const io::TokenSplit& split, const Launch& launch,
                 const DeviceRate& rate = {}, Configure configure = {}) {
  std::optional<int> rc;  // empty: no model of this build runs the flags (main.cpp refuses most such flags first)
  schedule::with_policy(f.schedule, [&]<class Schedule>() {
    auto run = [&]<int P>() {
      // Tensor-parallel ranks are processes, and a CUDA run is one process (main.cpp).
      if constexpr (std::is_same_v<typename Backend::space, HostSpace> && std::is_same_v<Schedule, schedule::OneFOneB> &&
                    P <= 2 && config.experts == 0) {
        if (f.tp == 2) rc = train<config, Schedule, P, Backend, 2>(f, corpus, split, launch, rate, configure);
        if (f.tp == 4) rc = train<config, Schedule, P, Backend, 4>(f, corpus, split, launch, rate, configure);
      }
      // Expert-parallel ranks are data-parallel replicas holding a share of the experts.
      if constexpr (std::is_same_v<typename Backend::space, HostSpace> && config.experts > 0 &&
                    (std::is_same_v<Schedule, schedule::OneFOneB> || std::is_same_v<Schedule, schedule::DualPipeV>)) {
        if (f.ep == 2) rc = train<config, Schedule, P, Backend, 1, Configure, 2>(f, corpus, split, launch, rate, configure);
        if (f.ep == 4) rc = train<config, Schedule, P, Backend, 1, Configure, 4>(f, corpus, split, launch, rate, configure);
      }
      if (f.tp == 1 && f.ep == 1) rc = train<config, Schedule, P, Backend>(f, corpus, split, launch, rate, configure);
    };
    if constexpr (examples::family_of<Schedule> == F && examples::trainer_builds<Schedule>) {
      if constexpr (Schedule::chunks == 1 && config.experts == 0) with_stage_count<1, 2, 4>(f.stages, run);
      else if constexpr (config.experts == 0 || Schedule::chunks == 1) with_stage_count<1, 2>(f.stages, run);
      // Models with experts: of the two-chunk schedules DualPipeV alone, whose overlapped pairs take
      // turns at the all-to-alls (pipeline/paired_turns.hpp), at 2 stages.
      else if constexpr (std::is_same_v<Schedule, schedule::DualPipeV>) with_stage_count<2>(f.stages, run);
    }
  });
  if (!rc)
    CUPIPE_THROW("this build trains no model with --schedule ", f.schedule, " --stages ", f.stages, " --tp ", f.tp, " --ep ",
                 f.ep, config.experts > 0 ? " and experts" : "", " (see --help for what each flag runs with)");
  return *rc;
}
/// backend::Host<bfloat16, float>: --precision bf16 on the host.
using HostBf16 = backend::Host<cupipe::bfloat16, float>;  // in full: OpenBLAS declares a ::bfloat16 too
// Each family x precision is compiled in one unit (train_*.cpp), not in main.cpp.
#define CUPIPE_GPT_TRAIN_FAMILY(B) \
  extern template int train_family<examples::ScheduleFamily::flush, B>(const Flags&, const io::TokenCorpus&, const io::TokenSplit&, const Launch&, const DeviceRate&, AsBuilt); \
  extern template int train_family<examples::ScheduleFamily::chunked, B>(const Flags&, const io::TokenCorpus&, const io::TokenSplit&, const Launch&, const DeviceRate&, AsBuilt); \
  extern template int train_family<examples::ScheduleFamily::asynchronous, B>(const Flags&, const io::TokenCorpus&, const io::TokenSplit&, const Launch&, const DeviceRate&, AsBuilt);
CUPIPE_GPT_TRAIN_FAMILY(backend::Host<T>)
CUPIPE_GPT_TRAIN_FAMILY(HostBf16)
#undef CUPIPE_GPT_TRAIN_FAMILY
/// --precision fp8-block and fp8-delayed on the host: the flush family only (train_fp8.cpp).
using HostFp8Block = backend::HostFp8<fp8::Blockwise>;
using HostFp8Delayed = backend::HostFp8<fp8::PerTensorDelayed>;
extern template int train_family<examples::ScheduleFamily::flush, HostFp8Block>(const Flags&, const io::TokenCorpus&, const io::TokenSplit&, const Launch&, const DeviceRate&, AsBuilt);
extern template int train_family<examples::ScheduleFamily::flush, HostFp8Delayed>(const Flags&, const io::TokenCorpus&, const io::TokenSplit&, const Launch&, const DeviceRate&, AsBuilt);

/// The mixtures of experts this trainer builds (--experts 8 with --top-k 1, or --top-k 2 and
/// --capacity 1.25): the tiny preset with every second block's MLP 8 experts of its shape. Top-1
/// dropless (Switch's routing) has the dense model's active parameters, plus the routers; top-2
/// with a capacity factor of 1.25 per sequence (GShard's) drops what overflows.
inline constexpr gpt::Config moe_of(index_t top_k, double capacity) {
  gpt::Config c = gpt::tiny;
  c.experts = 8;
  c.top_k = top_k;
  c.moe_every = 2;
  c.capacity_factor = capacity;
  return c;
}
inline constexpr gpt::Config moe_top1 = moe_of(1, 0);
inline constexpr gpt::Config moe_top2 = moe_of(2, 1.25);
/// Which of them --experts, --top-k and --capacity name: 1 (moe_top1), 2 (moe_top2), or 0, none.
inline int moe_preset(const Flags& f) {
  if (f.experts != moe_top1.experts) return 0;
  if (f.expert_top_k == moe_top1.top_k && f.capacity == moe_top1.capacity_factor) return 1;
  if (f.expert_top_k == moe_top2.top_k && f.capacity == moe_top2.capacity_factor) return 2;
  return 0;
}
/// Why --experts, --top-k and --capacity name no model this trainer builds; empty when they do.
inline std::string moe_presets_refusal(const Flags& f) {
  if (f.experts == 0 || moe_preset(f) != 0) return {};
  return "--experts " + std::to_string(f.experts) + " --top-k " + std::to_string(f.expert_top_k) + " --capacity " +
         examples::exact_text(f.capacity) + ": this trainer builds the tiny preset with --experts 8 and either --top-k 1 "
         "(dropless) or --top-k 2 --capacity 1.25 (each a model type of its own, compiled in train_moe.cpp)";
}
/// Trains a mixture of experts (--experts): the flush schedules at 1 or 2 stages, fp32 on the host
/// (train_moe.cpp).
int train_moe(const Flags& f, const io::TokenCorpus& corpus, const io::TokenSplit& split, const Launch& launch);

/// Trains on the CUDA backend, every schedule in fp32 and bf16 (defined in trainer_cuda.cu; only in
/// builds with CUDA).
int train_cuda(const Flags& f, const io::TokenCorpus& corpus, const io::TokenSplit& split, const Launch& launch);

}  // namespace gpt_trainer
