// SPDX-License-Identifier: Apache-2.0
// A small GPT (4 blocks, C 64, 4 heads, T 32, V 256, lm_head tied to wte) in float64 through every
// flush schedule at p = 1, 2, 4: the unpipelined Network's loss and gradients after one
// forward_backward, its weights after 3 AdamW steps, to 1e-12 relative; the tied copies stay bitwise
// equal. Microbatches are whole sequences, ragged ones included. Untied, PipeDream and 2BW keep their
// documented semantics. Packed sequences (document borders) equal the Network given the same
// borders, and borders that do not fit the pipeline are refused before any work. A GPT whose MLPs
// are mixtures of experts equals the Network too, through the schedules that split B and W and
// overlap F&B pairs, with the same drops and auxiliary losses; DualPipeV trains 1F1B's weights bit
// for bit (without clipping, whose norm sums the stages' squares in another grouping).
#include "pipeline_test_support.hpp"

#include <array>
#include <cstring>
#include <optional>
#include <string>

#include "cupipe/gpt/model.hpp"

namespace {

using namespace cupipe;
using test::Host;

constexpr gpt::Config config{256, 32, 4, 4, 64};
using Gpt = gpt::Model<config>;
constexpr gpt::Config untied_config{256, 32, 4, 4, 64, false};
using UntiedGpt = gpt::Model<untied_config>;
constexpr std::uint64_t seed = 20261124;
constexpr double tolerance = 1e-12;
constexpr index_t T = config.context;

/// `sequences` windows of T + 1 tokens: inputs are the first T, labels the last T (the next token).
struct TokenBatch {
  std::vector<std::int32_t> ids, labels;
  index_t rows = 0;
  TokenBatch(index_t sequences, std::uint64_t salt) : rows(sequences * T) {
    Rng rng(salt);
    for (index_t s = 0; s < sequences; ++s) {
      std::vector<std::int32_t> window(std::size_t(T + 1));
      for (auto& t : window) t = std::int32_t(rng.below(std::uint64_t(config.vocab)));
      ids.insert(ids.end(), window.begin(), window.end() - 1);
      labels.insert(labels.end(), window.begin() + 1, window.end());
    }
  }
  ConstView<std::int32_t> x() const { return {ids.data(), Shape{rows, 1}}; }
  ConstView<std::int32_t> y() const { return {labels.data(), Shape{rows}}; }
};

/// The two copies of the tied table in a flat parameter array are bitwise equal.
template <class Model>
bool tied_copies_equal(const std::vector<double>& params) {
  constexpr TiedCopies tied = Model::body::tied;
  if constexpr (tied.count == 0) return true;
  else return std::memcmp(params.data() + tied.first, params.data() + tied.second, std::size_t(tied.count) * sizeof(double)) == 0;
}

template <class Policy, int P, class Model = Gpt>
void check_against_network() {
  using Stages = partition_for<Model, P, Policy>;
  using Pipe = Pipeline<Stages, Policy, Host>;
  using Reference = Network<Model, Host>;
  static_assert(Pipe::rows_per_sample == T);
  // 4 microbatches, or the fewest above that the policy takes (DualPipeV: 2p).
  constexpr int m = [] {
    int k = 4;
    while (!schedule::check<Policy>({P, k, Policy::chunks, 1}).empty()) ++k;
    return k;
  }();
  INFO(Policy::name << " p = " << P << " m = " << m);
  const optim::AdamW adamw({.lr = 3e-3, .weight_decay = 0.1, .clip_norm = 1.0});
  PipelineOptions options;
  options.microbatches = m;
  options.seed = seed;
  std::optional<Pipe> pipe;
  pipe.emplace(options);
  Reference net(seed);
  REQUIRE(test::bitwise_equal(pipe->parameters(), net.parameters()));
  CHECK(tied_copies_equal<Model>(net.parameters()));

  // 6 sequences in 4 microbatches: 2, 2, 1, 1 sequences, never a cut inside one (m sequences above 6).
  const TokenBatch batch(std::max(6, m), 11);
  const StepStats stats = test::bounded(120, [&] { return pipe->forward_backward(batch.x(), batch.y()); });
  const double loss = net.forward_backward(batch.x(), batch.y());
  CHECK(std::abs(stats.loss - loss) <= tolerance * std::abs(loss));
  CHECK(test::relative_difference(pipe->gradients(), net.gradients()) <= tolerance);
  CHECK(stats.samples == batch.rows);

  pipe.emplace(options);
  Reference trained(seed);
  std::vector<std::vector<double>> slots;
  for (int step = 0; step < 3; ++step) {
    const TokenBatch b(m, 100 + std::uint64_t(step));
    const StepStats s = test::bounded(120, [&] { return pipe->train_step(b.x(), b.y(), adamw); });
    trained.zero_grad();
    const double l = trained.forward_backward(b.x(), b.y());
    CHECK(std::abs(s.loss - l) <= tolerance * std::abs(l));
    const double norm = test::reference_update(trained, adamw, slots, step);
    CHECK(s.grad_norm == Approx(norm).epsilon(1e-12));
  }
  CHECK(test::relative_difference(pipe->parameters(), trained.parameters()) <= tolerance);
  CHECK(test::relative_difference(pipe->optimizer_state(1), slots[1]) <= tolerance);
  CHECK(tied_copies_equal<Model>(pipe->parameters()));
}

template <class Policy>
void check_every_p() {
  check_against_network<Policy, 1>();
  check_against_network<Policy, 2>();
  check_against_network<Policy, 4>();
}

}  // namespace

TEST_CASE("GPT: GPipe and 1F1B equal the unpipelined Network at p = 1, 2, 4", "[pipeline][equivalence][gpt]") {
  check_every_p<schedule::GPipe>();
  check_every_p<schedule::OneFOneB>();
}

TEST_CASE("GPT: Interleaved<2> equals the unpipelined Network at p = 1, 2, 4", "[pipeline][equivalence][gpt]") {
  check_every_p<schedule::Interleaved<2>>();
}

TEST_CASE("GPT: ZB-H1 and ZB-H2 (B and W split in every layer) equal the Network at p = 1, 2, 4",
          "[pipeline][equivalence][gpt]") {
  check_every_p<schedule::ZeroBubbleH1>();
  check_every_p<schedule::ZeroBubbleH2>();
}

TEST_CASE("GPT: BFS (looped breadth-first) equals the unpipelined Network at p = 1, 2, 4", "[pipeline][equivalence][gpt]") {
  check_every_p<schedule::BreadthFirst<2>>();
}

TEST_CASE("GPT: ZBV (V-shaped: wte and lm_head on worker 0, B and W split) equals the Network at p = 1, 2, 4",
          "[pipeline][equivalence][gpt]") {
  check_every_p<schedule::ZeroBubbleV>();
}

TEST_CASE("GPT: V-Min and V-Half equal the Network at p = 1, 2, 4", "[pipeline][equivalence][gpt]") {
  check_every_p<schedule::VMin>();
  check_every_p<schedule::VHalf>();
}

TEST_CASE("GPT: DualPipeV (wte and lm_head on worker 0, overlapped F&B pairs) equals the Network at p = 1, 2, 4",
          "[pipeline][equivalence][gpt]") {
  check_every_p<schedule::DualPipeV>();
}

namespace {

// Every second block's MLP a mixture of 4 experts, top-2, with a capacity that drops (layers/moe.hpp).
constexpr gpt::Config moe_config{256, 32, 4, 4, 64, true, 4, 2, 2, 1.0};
using MoeGpt = gpt::Model<moe_config>;
static_assert(moe_config.moe_blocks() == 2 && moe_config.parameters() == MoeGpt::body::param_count);
static_assert(moe_config.active_parameters() < moe_config.unique_parameters());

/// The MoE GPT's tally over a pipeline's workers against the Network's, after one forward_backward:
/// the same slots dropped, the same load per expert, and the same auxiliary losses.
template <class Policy, int P>
void check_moe_tally() {
  using Pipe = Pipeline<partition_for<MoeGpt, P, Policy>, Policy, Host>;
  PipelineOptions options;
  options.microbatches = 2 * P;
  options.seed = seed;
  Pipe pipe(options);
  Network<MoeGpt, Host> net(seed);
  std::array<moe::Tally, Pipe::stages> tallies;
  [&]<int... W>(std::integer_sequence<int, W...>) {
    ((pipe.template backend<W>().moe_tally = &tallies[std::size_t(W)]), ...);
  }(std::make_integer_sequence<int, Pipe::stages>());
  moe::Tally expected, got;
  net.backend().moe_tally = &expected;
  const TokenBatch batch(4 * P, 21);
  test::bounded(120, [&] { return pipe.forward_backward(batch.x(), batch.y()); });
  net.forward_backward(batch.x(), batch.y());
  for (const moe::Tally& t : tallies) got.add(t);
  INFO(Policy::name << " p = " << P);
  CHECK(expected.dropped > 0);
  CHECK(got.dropped == expected.dropped);
  CHECK(got.routed == expected.routed);
  CHECK(got.load == expected.load);
  CHECK(got.layers == 2 * int(options.microbatches));
  CHECK(got.aux_loss == Approx(expected.aux_loss).epsilon(1e-12));
  CHECK(test::relative_difference(pipe.gradients(), net.gradients()) <= tolerance);
}

/// The MoE GPT's weights after 3 AdamW steps of `Policy` on 2 workers (8 microbatches), without
/// clipping: the clipping norm sums each stage's squares, and DualPipeV's 4 virtual stages group that
/// sum otherwise than 1F1B's 2 (its last bits); every other sum runs in the same order.
template <class Policy>
std::vector<double> moe_weights_after_steps() {
  using Pipe = Pipeline<partition_for<MoeGpt, 2, Policy>, Policy, Host>;
  PipelineOptions options;
  options.microbatches = 8;
  options.seed = seed;
  Pipe pipe(options);
  const optim::AdamW adamw({.lr = 3e-3, .weight_decay = 0.1, .clip_norm = 0});
  for (int step = 0; step < 3; ++step) {
    const TokenBatch b(8, 300 + std::uint64_t(step));
    test::bounded(120, [&] { return pipe.train_step(b.x(), b.y(), adamw); });
  }
  return pipe.parameters();
}

}  // namespace

TEST_CASE("GPT with experts: DualPipeV (overlapped F&B pairs) trains 1F1B's weights bit for bit",
          "[pipeline][gpt][moe]") {
  const std::vector<double> one = moe_weights_after_steps<schedule::OneFOneB>();
  const std::vector<double> dual = moe_weights_after_steps<schedule::DualPipeV>();
  CHECK(test::bitwise_equal(dual, one));
}

TEST_CASE("GPT with experts: GPipe, 1F1B, ZB-H1 and DualPipeV equal the Network, auxiliary losses and drops included",
          "[pipeline][equivalence][gpt][moe]") {
  check_against_network<schedule::GPipe, 2, MoeGpt>();
  check_against_network<schedule::OneFOneB, 4, MoeGpt>();
  check_against_network<schedule::ZeroBubbleH1, 2, MoeGpt>();  // B and W split: the MoE layer's kept gradients
  check_against_network<schedule::DualPipeV, 2, MoeGpt>();     // overlapped F&B pairs
  check_moe_tally<schedule::OneFOneB, 2>();
  check_moe_tally<schedule::DualPipeV, 2>();
}

TEST_CASE("GPT: the tied copies are two tensors to the model, untied, each trains on its own", "[pipeline][gpt]") {
  STATIC_REQUIRE(Gpt::body::tied.count == config.vocab * config.channels);
  STATIC_REQUIRE(Gpt::body::tied.second == Gpt::body::param_offsets[Gpt::body::size - 1]);
  STATIC_REQUIRE(UntiedGpt::body::tied.count == 0);
  STATIC_REQUIRE(config.unique_parameters() == config.parameters() - config.vocab * config.channels);
  check_against_network<schedule::OneFOneB, 2, UntiedGpt>();
  // Without summing, the copies part after one update: the tie is what keeps them equal.
  Network<Gpt, Host> net(seed);
  const TokenBatch b(2, 5);
  net.forward_backward(b.x(), b.y());
  std::vector<std::vector<double>> slots;
  const optim::AdamW adamw({.lr = 1e-2});
  std::vector<double> untied_update = net.parameters();
  {
    Network<Gpt, Host> other(seed);
    other.forward_backward(b.x(), b.y());
    const double norm = std::sqrt(sum_of_squares(other.backend(), ConstView<double>{other.gradient_data(), Shape{Gpt::body::param_count}}));
    std::vector<double> s0(std::size_t(Gpt::body::param_count)), s1(s0.size());
    const std::array<TensorView<double>, 2> views{TensorView<double>{s0.data(), Shape{Gpt::body::param_count}},
                                                  TensorView<double>{s1.data(), Shape{Gpt::body::param_count}}};
    adamw.update(other.backend(), TensorView<double>{other.parameter_data(), Shape{Gpt::body::param_count}},
                 ConstView<double>{other.gradient_data(), Shape{Gpt::body::param_count}}, std::span<const TensorView<double>>(views), 0,
                 optim::clip_factor(norm, adamw.clip_norm()));
    untied_update = other.parameters();
  }
  CHECK_FALSE(tied_copies_equal<Gpt>(untied_update));
  test::reference_update(net, adamw, slots, 0);
  CHECK(tied_copies_equal<Gpt>(net.parameters()));
}

TEST_CASE("GPT: PipeDream refuses tied weights, untied, 2BW follows its delayed-gradient recurrence", "[pipeline][gpt]") {
  PipelineOptions options;
  options.microbatches = 2;
  CHECK_THAT(test::error_message([&] { Pipeline<partition<Gpt, 2>, schedule::PipeDream, Host> pipe(options); }),
             Catch::Contains("ties a layer to its input embedding (as GPT-2 ties lm_head to wte)"));

  // 2BW: W(t+1) = W(t) - lr * grad f_t(W(t-1)), W(-1) = W(0), with a Network computing the gradients.
  options.seed = seed;
  Pipeline<partition<UntiedGpt, 2>, schedule::PipeDream2BW, Host> pipe(options);
  Network<UntiedGpt, Host> net(seed);
  constexpr double lr = 0.05;
  std::vector<std::vector<double>> history{net.parameters(), net.parameters()};
  for (int step = 0; step < 3; ++step) {
    const TokenBatch b(4, 300 + std::uint64_t(step));
    test::bounded(120, [&] { return pipe.train_step(b.x(), b.y(), optim::SGD({.lr = lr})); });
    net.set_parameters(history[history.size() - 2]);
    net.zero_grad();
    net.forward_backward(b.x(), b.y());
    const std::vector<double> g = net.gradients();
    std::vector<double> next = history.back();
    for (std::size_t k = 0; k < next.size(); ++k) next[k] -= lr * g[k];
    history.push_back(std::move(next));
    INFO("after step " << step);
    CHECK(test::relative_difference(pipe.parameters(), history.back()) <= tolerance);
  }
}

TEST_CASE("GPT: a batch that is not whole sequences, or too few of them, is refused with the reason",
          "[pipeline][gpt][errors]") {
  PipelineOptions options;
  options.microbatches = 4;
  Pipeline<partition<Gpt, 2>, schedule::OneFOneB, Host> pipe(options);
  const TokenBatch batch(3, 1);
  CHECK_THAT(test::error_message([&] { pipe.forward_backward(batch.x(), batch.y()); }),
             Catch::Contains("a batch of 3 samples cannot be split into 4 microbatches"));
  const ConstView<std::int32_t> cut{batch.ids.data(), Shape{T + 5, 1}};
  const ConstView<std::int32_t> cut_labels{batch.labels.data(), Shape{T + 5}};
  CHECK_THAT(test::error_message([&] { pipe.forward_backward(cut, cut_labels); }),
             Catch::Contains("a batch of 37 rows is not whole samples of 32 rows"));
  std::vector<double> out(std::size_t((T + 5) * config.vocab));
  CHECK_THAT(test::error_message([&] { pipe.predict(cut, TensorView<double>{out.data(), Shape{T + 5, config.vocab}}); }),
             Catch::Contains("the input's 37 rows are not whole samples of 32 rows"));
}

TEST_CASE("GPT: a bad token id or label is named by its row in the caller's batch and its microbatch, before any work",
          "[pipeline][gpt][errors]") {
  PipelineOptions options;
  options.microbatches = 2;
  Pipeline<partition<Gpt, 2>, schedule::OneFOneB, Host> pipe(options);
  const std::vector<double> before = pipe.parameters();
  TokenBatch batch(4, 2);  // 4 sequences of T = 32 rows: microbatch 1 holds rows 64..127
  batch.ids[std::size_t(T * 3 + 5)] = std::int32_t(config.vocab);
  CHECK_THAT(test::error_message([&] { pipe.forward_backward(batch.x(), batch.y()); }),
             Catch::Contains("Pipeline::forward_backward: token id 256 at row 101 of the batch (microbatch 1, its row 37) "
                             "is outside ") &&
                 Catch::Contains("'s vocabulary [0, 256)"));
  batch.ids[std::size_t(T * 3 + 5)] = 0;
  batch.labels[std::size_t(T + 2)] = -1;
  CHECK_THAT(test::error_message([&] { pipe.forward_backward(batch.x(), batch.y()); }),
             Catch::Contains("label -1 at row 34 of the batch (microbatch 0, its row 34)") &&
                 Catch::Contains("'s classes [0, 256)"));
  CHECK(pipe.parameters() == before);
}

TEST_CASE("GPT: weight decay on the matrices only (DecayOn::matrices) through 1F1B and ZBV equals the Network's",
          "[pipeline][equivalence][gpt][optim]") {
  const optim::AdamW matrices({.lr = 3e-3, .weight_decay = 0.5, .clip_norm = 1.0, .decay_on = optim::DecayOn::matrices});
  const optim::AdamW all({.lr = 3e-3, .weight_decay = 0.5, .clip_norm = 1.0});
  PipelineOptions options;
  options.microbatches = 4;
  options.seed = seed;
  auto train = [&]<class Pipe>(Pipe& pipe, const optim::AdamW& adamw, int steps) {
    for (int step = 0; step < steps; ++step) {
      const TokenBatch b(4, 100 + std::uint64_t(step));
      test::bounded(120, [&] { return pipe.train_step(b.x(), b.y(), adamw); });
    }
    return pipe.parameters();
  };
  Pipeline<partition<Gpt, 2>, schedule::OneFOneB, Host> one_f_one_b(options);
  Pipeline<partition_for<Gpt, 2, schedule::ZeroBubbleV>, schedule::ZeroBubbleV, Host> zbv(options);
  const std::vector<double> pipelined = train(one_f_one_b, matrices, 3), v_shaped = train(zbv, matrices, 3);

  Network<Gpt, Host> net(seed);
  std::vector<std::vector<double>> slots;
  for (int step = 0; step < 3; ++step) {
    const TokenBatch b(4, 100 + std::uint64_t(step));
    net.zero_grad();
    net.forward_backward(b.x(), b.y());
    test::reference_update(net, matrices, slots, step);
  }
  CHECK(test::relative_difference(pipelined, net.parameters()) <= tolerance);
  CHECK(test::relative_difference(v_shaped, net.parameters()) <= tolerance);
  CHECK(tied_copies_equal<Gpt>(pipelined));

  // One step from the same weights (biases and LayerNorm shifts moved off 0, where decay does not
  // show): the matrices and embeddings take the same update with either setting, bit for bit; every
  // bias and LayerNorm tensor differs (it decays only with DecayOn::all).
  Pipeline<partition<Gpt, 2>, schedule::OneFOneB, Host> masked(options), unmasked(options);
  std::vector<double> start = masked.parameters();
  for (const ParamInfo& p : Gpt::body::parameter_table())
    if (p.shape.rank() == 1)
      for (index_t i = p.offset; i < p.offset + p.numel; ++i) start[std::size_t(i)] += 0.5;
  masked.set_parameters(start);
  unmasked.set_parameters(start);
  const std::vector<double> spared = train(masked, matrices, 1), decayed = train(unmasked, all, 1);
  for (const ParamInfo& p : Gpt::body::parameter_table()) {
    INFO(p.name);
    const bool same = std::memcmp(spared.data() + p.offset, decayed.data() + p.offset, std::size_t(p.numel) * sizeof(double)) == 0;
    CHECK(same == (p.shape.rank() == 2));
  }
}

namespace {

/// Packed sequences: a batch of `sequences` windows whose token `separator` begins a document, at
/// 1 to 3 random places per sequence, and their borders (document_starts).
struct PackedBatch : TokenBatch {
  static constexpr std::int32_t separator = 7;
  std::vector<std::int32_t> starts;
  PackedBatch(index_t sequences, std::uint64_t salt) : TokenBatch(sequences, salt) {
    Rng rng(salt + 1);
    for (index_t s = 0; s < sequences; ++s)
      for (std::uint64_t k = 0, n = 1 + rng.below(3); k < n; ++k) ids[std::size_t(s * T) + 1 + rng.below(std::uint64_t(T - 1))] = separator;
    starts = document_starts(ids, T, separator);
  }
  DocumentStarts documents() const { return {starts.data(), rows}; }
};

/// Packed sequences through `Policy` on P workers: the unpipelined Network given the same borders,
/// after one forward_backward (loss and gradients) and after 3 AdamW steps (weights), to 1e-12.
template <class Policy, int P>
void check_packed_against_network() {
  using Pipe = Pipeline<partition_for<Gpt, P, Policy>, Policy, Host>;
  INFO(Policy::name << " p = " << P);
  PipelineOptions options;
  options.microbatches = 4;
  options.seed = seed;
  options.packed_sequences = true;
  std::optional<Pipe> pipe;
  pipe.emplace(options);
  Network<Gpt, Host> net(seed);
  // 6 sequences in 4 microbatches (2, 2, 1, 1): each microbatch takes its own rows' borders.
  const PackedBatch batch(6, 12);
  REQUIRE(batch.starts != std::vector<std::int32_t>(batch.starts.size(), 0));
  const StepStats stats = test::bounded(120, [&] { return pipe->forward_backward(batch.x(), batch.y(), batch.documents()); });
  net.backend().documents = batch.documents();
  const double loss = net.forward_backward(batch.x(), batch.y());
  CHECK(std::abs(stats.loss - loss) <= tolerance * std::abs(loss));
  CHECK(test::relative_difference(pipe->gradients(), net.gradients()) <= tolerance);
  // The borders matter: the same tokens as whole sequences give another loss.
  Network<Gpt, Host> plain(seed);
  CHECK(std::abs(plain.forward_backward(batch.x(), batch.y()) - loss) > 1e-6 * std::abs(loss));
  // No action leaves its microbatch's borders on a context.
  for (int w = 0; w < P; ++w) CHECK(pipe->backend(w).documents.empty());

  const optim::AdamW adamw({.lr = 3e-3, .weight_decay = 0.1, .clip_norm = 1.0});
  pipe.emplace(options);
  Network<Gpt, Host> trained(seed);
  std::vector<std::vector<double>> slots;
  for (int step = 0; step < 3; ++step) {
    const PackedBatch b(4, 200 + std::uint64_t(step));
    const StepStats s = test::bounded(120, [&] { return pipe->train_step(b.x(), b.y(), adamw, b.documents()); });
    trained.zero_grad();
    trained.backend().documents = b.documents();
    const double l = trained.forward_backward(b.x(), b.y());
    trained.backend().documents = {};
    CHECK(std::abs(s.loss - l) <= tolerance * std::abs(l));
    test::reference_update(trained, adamw, slots, step);
  }
  CHECK(test::relative_difference(pipe->parameters(), trained.parameters()) <= tolerance);
}

}  // namespace

TEST_CASE("GPT: packed sequences (document borders) through GPipe, 1F1B, ZB-H1 and Interleaved<2> equal the Network",
          "[pipeline][equivalence][gpt][documents]") {
  check_packed_against_network<schedule::GPipe, 2>();
  check_packed_against_network<schedule::OneFOneB, 2>();
  check_packed_against_network<schedule::ZeroBubbleH1, 2>();  // W passes read the borders too
  check_packed_against_network<schedule::Interleaved<2>, 2>();
}

TEST_CASE("GPT: document borders without packed_sequences, or none with it, are refused before any work",
          "[pipeline][gpt][documents]") {
  using Pipe = Pipeline<partition<Gpt, 2>, schedule::OneFOneB, Host>;
  const optim::AdamW adamw({.lr = 3e-3});
  const PackedBatch batch(4, 5);
  PipelineOptions options{.microbatches = 2, .seed = seed};
  Pipe plain(options);
  CHECK_THROWS_WITH(plain.train_step(batch.x(), batch.y(), adamw, batch.documents()),
                    Catch::Contains("document borders given, but the pipeline was built without PipelineOptions::packed_sequences"));
  options.packed_sequences = true;
  Pipe packed(options);
  CHECK_THROWS_WITH(packed.train_step(batch.x(), batch.y(), adamw),
                    Catch::Contains("built with PipelineOptions::packed_sequences, so every batch needs its document borders"));
  std::vector<std::int32_t> bad = batch.starts;
  bad[1] = 5;  // token 1 of sequence 0 cannot start at 5
  CHECK_THROWS_WITH(packed.train_step(batch.x(), batch.y(), adamw, DocumentStarts{bad.data(), batch.rows}),
                    Catch::Contains("row 1 (token 1 of sequence 0) has document start 5"));
  CHECK_THROWS_WITH(packed.train_step(batch.x(), batch.y(), adamw, DocumentStarts{batch.starts.data(), batch.rows - T}),
                    Catch::Contains("document starts for 96 rows, but the batch has 128"));
  // Nothing ran: the weights are the initial ones.
  CHECK(test::bitwise_equal(packed.parameters(), Network<Gpt, Host>(seed).parameters()));
}
