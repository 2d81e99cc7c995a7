// SPDX-License-Identifier: Apache-2.0
// A pipeline whose workers have different backends (backend::PerWorker): here fp32, fp64 and
// bf16 host stages in one pipeline, each hand-over converting the activation or gradient into the
// receiver's storage type. The oracle is the unpipelined model in the same per-stage precision: the
// stages run one after the other on each microbatch, each on its own backend type, with the values
// converted at the same boundaries; every synchronous schedule must match it bit for bit (the same
// arithmetic in the same order), and it must differ from the model in one precision (otherwise
// nothing was converted).
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cupipe/gpt/model.hpp"
#include "cupipe/pipeline/hand_over.hpp"
#include "pipeline_test_support.hpp"

using namespace cupipe;
using namespace cupipe::test;

namespace {

using BF = cupipe::bfloat16;  // OpenBLAS's cblas.h declares a ::bfloat16 of its own
using F32 = backend::Host<float>;
using F64 = backend::Host<double>;
using B16 = backend::Host<BF, float>;

// Six Linear-led units, so that 2, 3 and 6 virtual stages each hold whole units.
using Units = StageList<Stage<Linear<6, 12>, GELU>, Stage<Linear<12, 12>, LayerNorm<12>>, Stage<Linear<12, 10>, ReLU>,
                        Stage<Linear<10, 10>, GELU>, Stage<Linear<10, 8>, LayerNorm<8>>, Stage<Linear<8, 5>>>;
using ThreeStages = StageList<Stage<Linear<6, 12>, GELU, Linear<12, 12>, LayerNorm<12>>,
                              Stage<Linear<12, 10>, ReLU, Linear<10, 10>, GELU>,
                              Stage<Linear<10, 8>, LayerNorm<8>, Linear<8, 5>>>;
using FourStages = StageList<Stage<Linear<6, 12>, GELU, Linear<12, 12>, LayerNorm<12>>, Stage<Linear<12, 10>, ReLU>,
                             Stage<Linear<10, 10>, GELU>, Stage<Linear<10, 8>, LayerNorm<8>, Linear<8, 5>>>;
constexpr index_t in_features = 6, classes = 5;

/// One virtual stage of the oracle on its own backend type: weights in use (storage), master
/// weights, gradients and optimizer state (compute), and what each microbatch's forward kept.
template <class Seq, class B>
struct OracleStage {
  using T = typename B::value_type;
  using G = grad_t<B>;
  static constexpr bool master_weights = !std::is_same_v<T, G>;
  B be;
  std::vector<T> params = std::vector<T>(static_cast<std::size_t>(Seq::param_count));
  std::vector<G> master = std::vector<G>(static_cast<std::size_t>(Seq::param_count));
  std::vector<G> grads = std::vector<G>(static_cast<std::size_t>(Seq::param_count), G(0));
  std::vector<std::vector<G>> slots;
  std::vector<std::vector<T>> inputs, records;  // [microbatch]

  template <class P>
  void load(const std::vector<P>& whole, index_t offset) {
    for (std::size_t i = 0; i < master.size(); ++i) master[i] = G(whole[std::size_t(offset) + i]);
    publish();
  }
  void publish() {
    for (std::size_t i = 0; i < master.size(); ++i) params[i] = pipeline::convert_value<T>(master[i]);
  }
  ViewOn<B, G> grad_view() { return {grads.data(), Shape{Seq::param_count}}; }
};

/// The unpipelined model with virtual stage K on backend type `Backends::at<K>`.
template <class Stages, class Backends>
class Oracle {
  static constexpr int V = int(Stages::size);
  template <int K>
  using Seq = typename Stages::template stage<K>;
  template <int K>
  using B = typename Backends::template at<K>;
  template <std::size_t... K>
  static auto make(std::index_sequence<K...>) -> std::tuple<std::unique_ptr<OracleStage<Seq<int(K)>, B<int(K)>>>...>;
  using Loss = typename Stages::loss;
  using Last = OracleStage<Seq<V - 1>, B<V - 1>>;

 public:
  using input_type = typename B<0>::value_type;

  template <class P>
  explicit Oracle(const std::vector<P>& parameters) {
    each([&]<int K>(std::integral_constant<int, K>) {
      auto& st = std::get<K>(stages_);
      st = std::make_unique<OracleStage<Seq<K>, B<K>>>();
      st->load(parameters, offset<K>());
    });
  }

  /// Forward and backward of every microbatch (equal parts of the batch) in order; gradients
  /// accumulate, each loss divided by the whole batch's rows, as a flush schedule does. Returns the
  /// batch's loss.
  double forward_backward(const std::vector<input_type>& x, const std::vector<std::int32_t>& labels, int microbatches) {
    const index_t n = index_t(labels.size()), rows = n / microbatches;
    double loss = 0;
    each([&]<int K>(std::integral_constant<int, K>) {
      std::get<K>(stages_)->inputs.assign(std::size_t(microbatches), {});
      std::get<K>(stages_)->records.assign(std::size_t(microbatches), {});
    });
    for (int j = 0; j < microbatches; ++j) {
      auto& first = *std::get<0>(stages_);
      first.inputs[std::size_t(j)].assign(x.begin() + j * rows * in_features, x.begin() + (j + 1) * rows * in_features);
      std::vector<typename Last::T> dy;
      forward<0>(j, rows, labels.data() + j * rows, n, loss, dy);
      backward<V - 1>(j, rows, std::move(dy));
    }
    return loss;
  }

  /// The flush update: the global norm from each stage's sum of squares in stage order, then each
  /// stage's optimizer on its master weights, which its weights in use become the rounding of.
  template <class Optimizer>
  void update(const Optimizer& optimizer, std::int64_t step) {
    double squares = 0;
    each([&]<int K>(std::integral_constant<int, K>) {
      auto& st = *std::get<K>(stages_);
      squares += sum_of_squares(st.be, ConstViewOn<B<K>, grad_t<B<K>>>(st.grad_view()));
    });
    const double scale = optim::clip_factor(std::sqrt(squares), optimizer.clip_norm());
    each([&]<int K>(std::integral_constant<int, K>) {
      auto& st = *std::get<K>(stages_);
      using G = grad_t<B<K>>;
      constexpr index_t count = Seq<K>::param_count;
      if (st.slots.empty()) st.slots.assign(Optimizer::slot_names.size(), std::vector<G>(std::size_t(count), G(0)));
      std::vector<ViewOn<B<K>, G>> views;
      for (auto& s : st.slots) views.push_back({s.data(), Shape{count}});
      optimizer.update(st.be, ViewOn<B<K>, G>{st.master.data(), Shape{count}}, ConstViewOn<B<K>, G>(st.grad_view()),
                       std::span<const ViewOn<B<K>, G>>(views), step, scale);
      st.publish();
      std::fill(st.grads.begin(), st.grads.end(), G(0));
    });
  }

  /// Every stage's master weights (or gradients) in the whole model's layout, widened to double.
  std::vector<double> parameters() { return whole([](auto& st) -> auto& { return st.master; }); }
  std::vector<double> gradients() { return whole([](auto& st) -> auto& { return st.grads; }); }

  /// Inference: the last stage's output (its storage type), widened to double.
  std::vector<double> predict(const std::vector<input_type>& x) {
    const index_t n = index_t(x.size()) / in_features;
    std::vector<double> out;
    auto input = x;
    run_forward<0>(n, std::move(input), out);
    return out;
  }

 private:
  template <class F>
  static void each(F&& f) {
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      (f(std::integral_constant<int, int(K)>{}), ...);
    }(std::make_index_sequence<std::size_t(V)>());
  }
  template <int K>
  static constexpr index_t offset() {
    return []<std::size_t... J>(std::index_sequence<J...>) {
      return (index_t{0} + ... + Seq<int(J)>::param_count);
    }(std::make_index_sequence<std::size_t(K)>());
  }
  template <class Field>
  std::vector<double> whole(Field field) {
    std::vector<double> out;
    each([&]<int K>(std::integral_constant<int, K>) {
      for (const auto& v : field(*std::get<K>(stages_))) out.push_back(pipeline::convert_value<double>(v));
    });
    return out;
  }

  /// Stage K's forward of microbatch j; the last stage adds the loss and starts the backward's dy.
  template <int K, class DY>
  void forward(int j, index_t rows, const std::int32_t* labels, index_t n, double& loss, DY& dy) {
    auto& st = *std::get<K>(stages_);
    using T = typename B<K>::value_type;
    auto& record = st.records[std::size_t(j)];
    record.assign(std::size_t(Seq<K>::record_elements(rows)), T(0));
    Seq<K>::forward(st.be, st.params.data(), ConstView<T>{st.inputs[std::size_t(j)].data(), Shape{rows, Seq<K>::in_features}},
                    record.data());
    const ConstView<T> out = Seq<K>::template output<HostSpace>(record.data(), rows);
    if constexpr (K + 1 < V) {
      auto& next = *std::get<K + 1>(stages_);
      using U = typename B<K + 1>::value_type;
      std::vector<U>& in = next.inputs[std::size_t(j)];
      in.resize(std::size_t(out.numel()));
      pipeline::convert_values(out.data(), in.data(), in.size());
      forward<K + 1>(j, rows, labels, n, loss, dy);
    } else {
      const ConstView<std::int32_t> y{labels, Shape{rows}};
      loss += double(loss_value<Loss>(st.be, out, y, n, true));
      dy.assign(std::size_t(rows * Seq<K>::out_features), T(0));
      Loss::backward(st.be, out, y, TensorView<T>{dy.data(), Shape{rows, Seq<K>::out_features}}, n);
    }
  }

  template <int K, class DY>
  void backward(int j, index_t rows, DY dy) {
    auto& st = *std::get<K>(stages_);
    using T = typename B<K>::value_type;
    std::vector<T> dx(std::size_t(K > 0 ? rows * Seq<K>::in_features : 0));
    std::vector<T> grad_record(std::size_t(Seq<K>::grad_record_elements(rows)));
    Seq<K>::backward(st.be, st.params.data(), ConstView<T>{st.inputs[std::size_t(j)].data(), Shape{rows, Seq<K>::in_features}},
                     st.records[std::size_t(j)].data(), ConstView<T>{dy.data(), Shape{rows, Seq<K>::out_features}},
                     K > 0 ? TensorView<T>{dx.data(), Shape{rows, Seq<K>::in_features}} : TensorView<T>{}, st.grads.data(),
                     grad_record.data(), true);
    if constexpr (K > 0) {
      using U = typename B<K - 1>::value_type;
      std::vector<U> previous(dx.size());
      pipeline::convert_values(dx.data(), previous.data(), dx.size());
      backward<K - 1>(j, rows, std::move(previous));
    }
  }

  template <int K, class In>
  void run_forward(index_t n, In input, std::vector<double>& out) {
    auto& st = *std::get<K>(stages_);
    using T = typename B<K>::value_type;
    std::vector<T> record(std::size_t(Seq<K>::record_elements(n)));
    Seq<K>::forward(st.be, st.params.data(), ConstView<T>{input.data(), Shape{n, Seq<K>::in_features}}, record.data());
    const ConstView<T> y = Seq<K>::template output<HostSpace>(record.data(), n);
    if constexpr (K + 1 < V) {
      using U = typename B<K + 1>::value_type;
      std::vector<U> next(std::size_t(y.numel()));
      pipeline::convert_values(y.data(), next.data(), next.size());
      run_forward<K + 1>(n, std::move(next), out);
    } else {
      for (index_t i = 0; i < y.numel(); ++i) out.push_back(pipeline::convert_value<double>(y.data()[i]));
    }
  }

  decltype(make(std::make_index_sequence<std::size_t(V)>())) stages_;
};

/// Each virtual stage's backend, written out by hand from the schedule's placement (not read from
/// the pipeline, whose placement table is under test too).
template <class... Bs>
struct StageBackends {
  template <int K>
  using at = std::tuple_element_t<std::size_t(K), std::tuple<Bs...>>;
};

template <class T>
std::vector<double> widen(const std::vector<T>& v) {
  std::vector<double> out;
  for (const T& x : v) out.push_back(pipeline::convert_value<double>(x));
  return out;
}

template <class T>
std::vector<T> inputs_as(const Batch& b) {
  std::vector<T> x;
  for (double v : b.x) x.push_back(pipeline::convert_value<T>(v));
  return x;
}

/// Two AdamW steps (the first clipped) of pipeline `Pipe` against the oracle, bit for bit: loss,
/// gradients, parameters and predictions. `Map` is each virtual stage's backend.
template <class Stages, class Schedule, class Spec, class Map>
void check_against_oracle(int microbatches) {
  using Pipe = Pipeline<Stages, Schedule, Spec>;
  static_assert(Pipe::mixed);
  using Ref = Oracle<Stages, Map>;
  using X = typename Ref::input_type;
  PipelineOptions options;
  options.microbatches = microbatches;
  options.seed = 11;
  Pipe pipe(options);
  Ref oracle(pipe.parameters());
  const index_t rows = 4 * microbatches;
  for (int step = 0; step < 2; ++step) {
    CAPTURE(step);
    // The first update clips: the global norm must be right.
    const optim::AdamW adamw({.lr = 0.01, .weight_decay = 0.01, .clip_norm = step == 0 ? 0.05 : 0.0});
    const Batch b = make_batch(rows, in_features, classes, 100 + std::uint64_t(step));
    const std::vector<X> x = inputs_as<X>(b);
    const StepStats stats = pipe.forward_backward(ConstView<X>{x.data(), Shape{rows, in_features}}, b.targets());
    const double loss = oracle.forward_backward(x, b.labels, microbatches);
    CHECK(stats.loss == Approx(loss).epsilon(1e-14));  // the pipeline weighs each loss by n / n
    const std::vector<double> grads = widen(pipe.gradients()), want_grads = oracle.gradients();
    CHECK(relative_difference(grads, want_grads) == 0.0);
    CHECK(bitwise_equal(grads, want_grads));
    pipe.step(adamw);
    oracle.update(adamw, step);
    CHECK(bitwise_equal(widen(pipe.parameters()), oracle.parameters()));
  }
  const Batch probe = make_batch(6, in_features, classes, 7);
  const std::vector<X> x = inputs_as<X>(probe);
  std::vector<typename Pipe::T> out(std::size_t(6 * classes));
  pipe.predict(ConstView<X>{x.data(), Shape{6, in_features}}, TensorView<typename Pipe::T>{out.data(), Shape{6, classes}});
  CHECK(bitwise_equal(widen(out), oracle.predict(x)));
}

}  // namespace

TEST_CASE("hand-over conversions: widening is exact, narrowing rounds to nearest even, once", "[pipeline][mixed]") {
  using pipeline::convert_value;
  CHECK(convert_value<double>(0.1f) == double(0.1f));
  CHECK(convert_value<float>(0.1) == 0.1f);
  CHECK(convert_value<BF>(1.0 + 1.0 / 256).bits == 0x3F80);  // halfway between 1 and 1 + 2^-7: to even, 1
  CHECK(convert_value<BF>(1.0 + 3.0 / 256).bits == 0x3F82);  // halfway between 1 + 2^-7 and 1 + 2^-6: even
  // Just above halfway by 2^-30, below float's resolution: through float it would tie and round to 1.
  CHECK(convert_value<BF>(1.0 + 1.0 / 256 + std::ldexp(1.0, -30)).bits == 0x3F81);
  CHECK(convert_value<BF>(-(1.0 + 1.0 / 256 + std::ldexp(1.0, -30))).bits == 0xBF81);
  CHECK(convert_value<BF>(1.0 + 1.0 / 256 - std::ldexp(1.0, -30)).bits == 0x3F80);
  CHECK(convert_value<double>(BF(1.5f)) == 1.5);
  // A float host stage and a bf16 one: the message is converted into the receiver's type.
  F32 a;
  B16 b;
  const std::vector<float> sent{1.0f + 1.0f / 512, -2.75f, 1.0f + 3.0f / 256};
  const std::uint16_t want[] = {0x3F80, 0xC030, 0x3F82};
  std::vector<BF> got(3);
  pipeline::hand_over<F32, B16, float, BF>(a, b, ConstView<float>{sent.data(), Shape{3}}, TensorView<BF>{got.data(), Shape{3}});
  for (std::size_t i = 0; i < sent.size(); ++i) CHECK(got[i].bits == want[i]);
}

TEST_CASE("fp32, fp64 and bf16 stages in one pipeline equal the same per-stage precision unpipelined, under "
          "GPipe, 1F1B, ZB-H1, ZB-H2, Interleaved<2>, ZBV, V-Half and DualPipeV",
          "[pipeline][mixed]") {
  SECTION("GPipe, 3 workers") {
    check_against_oracle<ThreeStages, schedule::GPipe, backend::PerWorker<F32, F64, B16>, StageBackends<F32, F64, B16>>(3);
  }
  SECTION("1F1B, 3 workers") {
    check_against_oracle<ThreeStages, schedule::OneFOneB, backend::PerWorker<B16, F32, F64>, StageBackends<B16, F32, F64>>(4);
  }
  SECTION("1F1B: two fp32 workers side by side hand over through transfer(), then to bf16") {
    check_against_oracle<ThreeStages, schedule::OneFOneB, backend::PerWorker<F32, F32, B16>, StageBackends<F32, F32, B16>>(3);
  }
  SECTION("ZB-H1 (B and W split), 3 workers") {
    check_against_oracle<ThreeStages, schedule::ZeroBubbleH1, backend::PerWorker<F64, B16, F32>, StageBackends<F64, B16, F32>>(3);
  }
  SECTION("ZB-H2, 3 workers") {
    check_against_oracle<ThreeStages, schedule::ZeroBubbleH2, backend::PerWorker<B16, F64, F32>, StageBackends<B16, F64, F32>>(4);
  }
  SECTION("Interleaved<2>: a worker's two virtual stages share its backend (k on worker k mod 2)") {
    check_against_oracle<FourStages, schedule::Interleaved<2>, backend::PerWorker<F32, B16>, StageBackends<F32, B16, F32, B16>>(4);
  }
  SECTION("ZBV (V-shaped): the first and last stages on worker 0's backend") {
    check_against_oracle<FourStages, schedule::ZeroBubbleV, backend::PerWorker<B16, F64>, StageBackends<B16, F64, F64, B16>>(4);
  }
  SECTION("V-Half (V-shaped)") {
    check_against_oracle<FourStages, schedule::VHalf, backend::PerWorker<F64, B16>, StageBackends<F64, B16, B16, F64>>(4);
  }
  SECTION("DualPipeV (F&B pairs, run back to back on host backends)") {
    check_against_oracle<FourStages, schedule::DualPipeV, backend::PerWorker<F32, B16>, StageBackends<F32, B16, B16, F32>>(4);
  }
  SECTION("Interleaved<2>, 3 workers of 6 virtual stages (k on worker k mod 3)") {
    check_against_oracle<Units, schedule::Interleaved<2>, backend::PerWorker<F64, F32, B16>,
                         StageBackends<F64, F32, B16, F64, F32, B16>>(3);
  }
}

TEST_CASE("a mixed pipeline's stages really run in their own precisions", "[pipeline][mixed]") {
  // The same model and seed, all in fp64: the mixed pipeline's gradients must differ from it (by
  // the bf16 stage's rounding), else the stages did not keep their own types.
  PipelineOptions options;
  options.microbatches = 2;
  options.seed = 3;
  Pipeline<ThreeStages, schedule::OneFOneB, backend::PerWorker<F64, B16, F64>> mixed(options);
  Pipeline<ThreeStages, schedule::OneFOneB, F64> wide(options);
  const Batch b = make_batch(8, in_features, classes, 9);
  mixed.forward_backward(b.inputs(), b.targets());
  wide.forward_backward(b.inputs(), b.targets());
  const double difference = relative_difference(mixed.gradients(), wide.gradients());
  CHECK(difference > 1e-5);  // bf16 has 8 significant bits
  CHECK(difference < 0.1);   // but it is the same model
  // parameters() moves the widest compute type, and a mixed pipeline loads an all-fp64 one's values.
  static_assert(std::is_same_v<decltype(mixed)::G, double>);
  mixed.set_parameters(wide.parameters());
  const std::vector<double> round_trip = mixed.parameters();
  std::vector<double> want = wide.parameters();
  // Worker 1 computes in float: its master weights are the fp64 values rounded to float.
  CHECK(relative_difference(round_trip, want) < 1e-7);
  CHECK(!bitwise_equal(round_trip, want));
}

TEST_CASE("one backend named per worker is the pipeline with that backend", "[pipeline][mixed]") {
  using Same = Pipeline<ThreeStages, schedule::OneFOneB, backend::PerWorker<F64, F64, F64>>;
  static_assert(!Same::mixed);
  PipelineOptions options;
  options.microbatches = 3;
  options.seed = 5;
  Same per_worker(options);
  Pipeline<ThreeStages, schedule::OneFOneB, F64> plain(options);
  const Batch b = make_batch(6, in_features, classes, 2);
  per_worker.forward_backward(b.inputs(), b.targets());
  plain.forward_backward(b.inputs(), b.targets());
  CHECK(bitwise_equal(per_worker.gradients(), plain.gradients()));
  CHECK(&per_worker.backend(1) != &per_worker.backend(2));
  CHECK(per_worker.memory(0).peak() > 0);
}

TEST_CASE("a mixed pipeline refuses what it does not support, naming it", "[pipeline][mixed]") {
  PipelineOptions options;
  options.post_validation = true;
  using Mixed = Pipeline<ThreeStages, schedule::OneFOneB, backend::PerWorker<F32, F64, B16>>;
  CHECK_THAT(error_message([&] { Mixed pipe(options); }), Catch::Contains("post_validation") &&
                                                              Catch::Contains("backend per worker"));
  // GPT-2 ties lm_head to wte: under 1F1B they sit on workers 0 and 1, here of different backends.
  constexpr gpt::Config tiny{32, 8, 2, 2, 16};
  using Gpt = gpt::Model<tiny>;
  using Tied = Pipeline<partition<Gpt, 2>, schedule::OneFOneB, backend::PerWorker<F32, B16>>;
  CHECK_THAT(error_message([] { Tied pipe; }), Catch::Contains("ties two copies") && Catch::Contains("host<F32>") &&
                                                   Catch::Contains("host<BF16, F32>"));
}
