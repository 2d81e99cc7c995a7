// SPDX-License-Identifier: Apache-2.0
// Trains a GPT-2-style transformer with a pipeline schedule on the CPU: byte-level text (Debian's
// fortunes by default, or any file or folder) or llm.c token shards. Prints per-step loss and
// tokens/s, held-out loss and bits per byte at each evaluation, a sample from the model at the end,
// and one JSON summary line; saves and resumes checkpoints with nanoGPT's parameter names.
//
//   gpt_train --schedule 1f1b --stages 2 --steps 2000 --sample 300
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "cli_checks.hpp"
#include "cupipe/cupipe.hpp"
#include "cupipe/pipeline/rebalance.hpp"
#include "cupipe/models/gpt.hpp"

using namespace cupipe;
using cupipe::examples::non_negative;
using cupipe::examples::positive;

namespace {

using T = float;
constexpr gpt::Config tiny = gpt::tiny;
using Model = gpt::Model<tiny>;

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
  double clip = 1.0;
  std::uint64_t seed = 0;
  std::int64_t eval_every = 100;
  int eval_batches = 8;
  double held_out = 0.05;
  int sample = 200;
  std::string prompt = "The ";
  double temperature = 0.8;
  int top_k = 40;
  std::string save, resume;
  std::int64_t save_every = 0;
  double max_seconds = 0;
  std::int64_t max_steps = 0;
  std::string progress = "auto";
  std::string backend = "host";
};

/// A pipeline seen through nanoGPT's parameter names: what save_checkpoint and load_checkpoint read
/// and write, so a nanoGPT GPT module loads the model file with load_state_dict.
template <class Pipe>
struct NanoGptNames {
  Pipe& pipe;
  std::vector<ParamInfo> parameter_table() const {
    std::vector<ParamInfo> table = Pipe::parameter_table();
    for (ParamInfo& p : table) p.name = gpt::nanogpt_name(tiny, p.name);
    return table;
  }
  std::vector<T> parameters() { return pipe.parameters(); }
  std::vector<T> optimizer_state(std::size_t slot) { return pipe.optimizer_state(slot); }
  void set_parameters(std::span<const T> values) { pipe.set_parameters(values); }
  template <class Optimizer>
  void set_optimizer_state(const Optimizer& o, std::size_t slot, std::span<const T> values, std::int64_t updates) {
    pipe.set_optimizer_state(o, slot, values, updates);
  }
};

/// Mean cross-entropy (nats per token) of the model on `batches` fixed batches of held-out windows.
template <class Pipe>
double held_out_loss(Pipe& pipe, const std::vector<std::int32_t>& tokens, int batch, int batches) {
  io::WindowLoader loader(tokens, tiny.context, batch);
  std::vector<std::int32_t> x, y;
  std::vector<T> logits;
  double total = 0;
  std::int64_t count = 0;
  for (int b = 0; b < batches; ++b) {
    loader.next(x, y);
    const index_t rows = index_t(x.size());
    logits.resize(std::size_t(rows * tiny.vocab));
    pipe.predict(ConstView<std::int32_t>{x.data(), Shape{rows, 1}}, TensorView<T>{logits.data(), Shape{rows, tiny.vocab}});
    for (index_t r = 0; r < rows; ++r) {
      const T* z = logits.data() + r * tiny.vocab;
      const double max = *std::max_element(z, z + tiny.vocab);
      double sum = 0;
      for (index_t v = 0; v < tiny.vocab; ++v) sum += std::exp(double(z[v]) - max);
      total += max + std::log(sum) - double(z[y[std::size_t(r)]]);
      ++count;
    }
  }
  return total / double(count);
}

/// Entropy (nats) of the tokens' frequencies: the loss of the best model that ignores context.
double unigram_entropy(const std::vector<std::int32_t>& tokens, index_t vocab) {
  std::vector<double> counts(std::size_t(vocab), 0.0);
  for (std::int32_t t : tokens) counts[std::size_t(t)] += 1;
  double h = 0;
  for (double c : counts)
    if (c > 0) h -= c / double(tokens.size()) * std::log(c / double(tokens.size()));
  return h;
}

/// Draws `count` tokens after `prompt`: each step runs the last T tokens (right-padded: causal
/// attention never looks ahead) and samples the next from the logits at the last real position, with
/// temperature and top-k.
template <class Pipe>
std::vector<std::int32_t> generate(Pipe& pipe, std::vector<std::int32_t> text, int count, double temperature, int top_k,
                                   Rng& rng) {
  const index_t Tn = tiny.context, V = tiny.vocab;
  std::vector<std::int32_t> window(static_cast<std::size_t>(Tn));
  std::vector<T> logits(std::size_t(Tn * V));
  std::vector<std::pair<double, std::int32_t>> ranked(static_cast<std::size_t>(V));
  for (int i = 0; i < count; ++i) {
    const std::size_t used = std::min<std::size_t>(text.size(), std::size_t(Tn));
    std::fill(window.begin(), window.end(), 0);
    std::copy(text.end() - std::ptrdiff_t(used), text.end(), window.begin());
    pipe.predict(ConstView<std::int32_t>{window.data(), Shape{Tn, 1}}, TensorView<T>{logits.data(), Shape{Tn, V}});
    const T* z = logits.data() + (used - 1) * std::size_t(V);
    for (index_t v = 0; v < V; ++v) ranked[std::size_t(v)] = {double(z[v]) / temperature, std::int32_t(v)};
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

/// Bytes as text for a terminal: control bytes other than newline and tab shown as '?'.
std::string printable(const std::vector<std::int32_t>& tokens) {
  std::string out;
  for (std::int32_t t : tokens) out += (t == '\n' || t == '\t' || t >= 32) && t != 127 ? char(t) : '?';
  return out;
}

template <class Schedule, int P>
int train(const Flags& f, const io::TokenCorpus& corpus, const io::TokenSplit& split) {
  using Stages = partition<Model, std::size_t(P * Schedule::chunks)>;
  using Pipe = Pipeline<Stages, Schedule, backend::Host<T>>;
  Pipe pipe({.microbatches = f.microbatches, .seed = f.seed});
  NanoGptNames<Pipe> named{pipe};
  optim::AdamW adamw({.lr = f.lr, .weight_decay = f.weight_decay, .clip_norm = f.clip,
                      .schedule = {f.warmup, f.steps, f.min_lr}});

  const bool bytes = f.shards.empty();
  std::printf("cupipe %s: GPT %s (V %lld, T %lld, %lld blocks, %lld heads, C %lld; %.2f M parameters, lm_head %s)\n",
              version_string, f.preset.c_str(), (long long)tiny.vocab, (long long)tiny.context, (long long)tiny.layers,
              (long long)tiny.heads, (long long)tiny.channels, double(tiny.unique_parameters()) / 1e6,
              tiny.tied ? "tied to wte" : "untied");
  std::printf("%s: %lld files, %zu tokens; %zu train, %zu held out\n", corpus.source.c_str(), (long long)corpus.files,
              corpus.tokens.size(), split.train.size(), split.held_out.size());
  std::printf("%s, %d stages x %d chunk(s); %d sequences (%d tokens) a step in %d microbatches; AdamW lr %g\n",
              std::string(Schedule::name).c_str(), P, Schedule::chunks, f.batch, f.batch * int(tiny.context), f.microbatches,
              f.lr);
  for (int k = 0; k < int(Stages::size); ++k) std::printf("  stage %d: %s\n", k, stage_description<Stages>(k).c_str());
  const double unigram = unigram_entropy(split.train, tiny.vocab);
  const double per_bit = bytes ? std::log(2.0) : 1.0;  // bits per byte for text; nats per token for shards
  const char* unit = bytes ? "bits per byte" : "nats per token";
  std::printf("unigram baseline (no context): %.4f nats = %.4f %s\n", unigram, unigram / per_bit, unit);

  io::TrainingState state;
  if (!f.resume.empty()) {
    state = io::load_checkpoint(f.resume, named, adamw);
    std::printf("resumed from %s: %lld updates, data position %lld\n", f.resume.c_str(), (long long)state.updates,
                (long long)state.batch);
  }
  io::WindowLoader loader(split.train, tiny.context, f.batch, 0, 1, std::uint64_t(state.batch));
  auto save = [&] {
    state.updates = pipe.updates();
    state.batch = std::int64_t(loader.position());
    state.extra = {{"preset", f.preset}, {"schedule", std::string(Schedule::name)}, {"stages", std::to_string(P)}};
    io::save_checkpoint(f.save, named, adamw, state);
    std::printf("saved %s (nanoGPT names) and %s\n", io::model_file(f.save).c_str(), io::state_file(f.save).c_str());
  };

  const bool bar = f.progress == "bar" || (f.progress == "auto" && isatty(STDOUT_FILENO));
  const bool quiet = f.progress == "none";
  std::vector<std::int32_t> x, y;
  nlohmann::json curve = nlohmann::json::array();
  double seconds = 0, last_loss = 0, eval_loss = 0, bubble_sum = 0;
  std::int64_t steps = 0;
  const auto start = std::chrono::steady_clock::now();
  auto evaluate = [&](std::int64_t step) {
    eval_loss = held_out_loss(pipe, split.held_out, f.batch, f.eval_batches);
    if (bar) std::printf("\n");
    std::printf("step %lld: held-out loss %.4f (%.4f %s), train loss %.4f, %.1f s\n", (long long)step, eval_loss,
                eval_loss / per_bit, unit, last_loss, seconds);
    curve.push_back({{"step", step}, {"seconds", seconds}, {"train_loss", last_loss}, {"held_out_loss", eval_loss}});
    std::fflush(stdout);
  };
  for (std::int64_t step = pipe.updates(); step < f.steps; ++step) {
    loader.next(x, y);
    const index_t rows = index_t(x.size());
    const auto t0 = std::chrono::steady_clock::now();
    const StepStats stats = pipe.train_step(ConstView<std::int32_t>{x.data(), Shape{rows, 1}},
                                            ConstView<std::int32_t>{y.data(), Shape{rows}}, adamw);
    const double step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    last_loss = stats.loss;
    bubble_sum += stats.bubble_fraction;
    ++steps;
    if (!quiet) {
      const double tokens_per_second = double(rows) / step_seconds;
      if (bar)
        std::printf("\rstep %lld/%lld  loss %.4f  lr %.2e  |g| %.3f  %.0f tokens/s ", (long long)step + 1, (long long)f.steps,
                    stats.loss, adamw.lr(step), stats.grad_norm, tokens_per_second);
      else if ((step + 1) % 10 == 0 || step == 0)
        std::printf("step %lld/%lld: loss %.4f, lr %.2e, grad norm %.3f, %.0f tokens/s\n", (long long)step + 1,
                    (long long)f.steps, stats.loss, adamw.lr(step), stats.grad_norm, tokens_per_second);
      std::fflush(stdout);
    }
    const bool last = step + 1 == f.steps || (f.max_steps > 0 && step + 1 >= f.max_steps) ||
                      (f.max_seconds > 0 && seconds >= f.max_seconds);
    if (f.eval_every > 0 && ((step + 1) % f.eval_every == 0 || last)) evaluate(step + 1);
    if (!f.save.empty() && (last || (f.save_every > 0 && (step + 1) % f.save_every == 0))) save();
    if (last) break;
  }
  if (bar) std::printf("\n");
  if (steps == 0 || f.eval_every == 0) evaluate(pipe.updates());

  std::string sample;
  if (f.sample > 0) {
    Rng rng(f.seed + 1);
    const std::vector<std::int32_t> prompt(f.prompt.begin(), f.prompt.end());
    sample = printable(generate(pipe, prompt, f.sample, f.temperature, f.top_k, rng));
    std::printf("--- sample (temperature %g, top-k %d) ---\n%s\n---\n", f.temperature, f.top_k, sample.c_str());
  }
  const nlohmann::json summary = {{"held_out_loss", eval_loss},
                                  {"held_out_bits_per_byte", bytes ? eval_loss / per_bit : 0.0},
                                  {"unigram_loss", unigram},
                                  {"train_loss", last_loss},
                                  {"steps", pipe.updates()},
                                  {"seconds", seconds},
                                  {"tokens_per_second", seconds > 0 ? double(steps * f.batch * tiny.context) / seconds : 0.0},
                                  {"bubble_fraction_measured", steps ? bubble_sum / double(steps) : 0.0},
                                  {"schedule", f.schedule},
                                  {"stages", f.stages},
                                  {"microbatches", f.microbatches},
                                  {"curve", curve}};
  std::printf("%s\n", summary.dump().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"Train a GPT-2-style transformer with a pipeline schedule (cupipe, CPU)"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--data", f.data, "text file or folder (byte-level, vocabulary 256)")->capture_default_str();
  app.add_option("--shards", f.shards, "llm.c token shard (.bin) or folder of them, instead of --data");
  app.add_option("--val-shards", f.val_shards, "held-out llm.c shards (default: the last --held-out of --shards)");
  app.add_option("--preset", f.preset, "model size: tiny (V 256, T 64, 4 x C 128); gpt2-124m needs the CUDA backend")
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
  app.add_option("--clip", f.clip, "global gradient-norm clip (0: none)")->capture_default_str()->check(non_negative);
  app.add_option("--seed", f.seed, "initialisation and sampling seed")->capture_default_str();
  app.add_option("--eval-every", f.eval_every, "steps between held-out evaluations (0: only at the end)")
      ->capture_default_str()
      ->check(non_negative);
  app.add_option("--eval-batches", f.eval_batches, "held-out batches per evaluation")->capture_default_str()->check(positive);
  app.add_option("--held-out", f.held_out, "fraction of the corpus held out (its end)")->capture_default_str()->check(positive);
  app.add_option("--sample", f.sample, "tokens to generate after training (0: none)")->capture_default_str()->check(non_negative);
  app.add_option("--prompt", f.prompt, "text the sample continues")->capture_default_str();
  app.add_option("--temperature", f.temperature, "sampling temperature")->capture_default_str()->check(positive);
  app.add_option("--top-k", f.top_k, "sample among the k likeliest tokens (0: all)")->capture_default_str()->check(non_negative);
  app.add_option("--save", f.save, "checkpoint prefix: PREFIX.safetensors (nanoGPT names) and PREFIX.state.safetensors");
  app.add_option("--save-every", f.save_every, "also save every N steps")->check(non_negative);
  app.add_option("--resume", f.resume, "checkpoint prefix to resume from (weights, AdamW state, data position)");
  app.add_option("--max-steps", f.max_steps, "stop (evaluate, save) after this many steps in total; the schedule "
                 "still spans --steps (0: no limit)")->check(non_negative);
  app.add_option("--max-seconds", f.max_seconds, "stop (evaluate, save) after this much training time (0: no limit)")
      ->check(non_negative);
  app.add_option("--progress", f.progress, "auto, bar, lines or none")->capture_default_str()->check(CLI::IsMember({"auto", "bar", "lines", "none"}));
  app.add_option("--backend", f.backend, "host (CPU)")->capture_default_str()->check(CLI::IsMember({"host", "cuda"}));
  CLI11_PARSE(app, argc, argv);

  try {
    if (f.backend == "cuda" || f.preset == "gpt2-124m")
      CUPIPE_THROW("--backend cuda and --preset gpt2-124m: the GPT's CUDA kernels are not built into this trainer yet; "
                   "use --backend host --preset tiny");
    CUPIPE_REQUIRE(f.held_out < 1, "--held-out must be below 1, got ", f.held_out);
    if (!f.save.empty()) io::check_writable(io::model_file(f.save), "--save");
    backend::Host<T>::set_blas_threads(1);  // the stage workers share the cores
    const io::TokenCorpus corpus = f.shards.empty() ? io::load_text(f.data) : io::load_llmc_shards(f.shards, tiny.vocab);
    io::TokenSplit split;
    if (f.val_shards.empty()) {
      split = io::split_held_out(corpus, f.held_out);
    } else {
      split.train = corpus.tokens;
      split.held_out = io::load_llmc_shards(f.val_shards, tiny.vocab).tokens;
    }
    int rc = 1;
    with_policy(f.schedule, [&]<class Schedule>() {
      if constexpr (Schedule::chunks == 1)
        with_stage_count<1, 2, 4>(f.stages, [&]<int P>() { rc = train<Schedule, P>(f, corpus, split); });
      else
        with_stage_count<1, 2>(f.stages, [&]<int P>() { rc = train<Schedule, P>(f, corpus, split); });
    });
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt_train: %s\n", e.what());
    return 1;
  }
}
