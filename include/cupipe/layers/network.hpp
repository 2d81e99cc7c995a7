// SPDX-License-Identifier: Apache-2.0
// Network<Model, Backend>: a whole model on one backend, unpipelined. It owns parameters and
// gradients and trains on a whole batch at once: the oracle that every synchronous pipeline schedule
// must reproduce, and the simplest way to run a model.
#pragma once

#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/layers/loss.hpp"
#include "cupipe/layers/sequential.hpp"

namespace cupipe {

/// The loss a model trains with: its own last layer, or softmax cross-entropy over its outputs.
template <class Model>
using loss_of_t = std::conditional_t<Model::has_loss, typename Model::loss, SoftmaxCrossEntropy<Model::body::out_features>>;

/// Element type of a model's input: int32 token ids when it starts with an Embedding.
template <class Body, class T>
using model_input_t = std::conditional_t<Body::takes_token_ids, std::int32_t, T>;

template <class Model, class Backend>
class Network {
 public:
  using T = typename Backend::value_type;  ///< storage: parameters in use, activations
  using G = grad_t<Backend>;               ///< compute: gradients, master weights, the loss
  /// Whether the parameters in use are a rounding of float master weights (bf16 storage).
  static constexpr bool master_weights = !std::is_same_v<T, G>;
  using Body = typename Model::body;
  using Loss = loss_of_t<Model>;
  using input_type = model_input_t<Body, T>;
  static constexpr index_t in_features = Body::in_features;
  static constexpr index_t out_features = Body::out_features;

  /// The backend is built in place from `backend_args` (a device id for CUDA); buffers keep a
  /// pointer to its memory tracker, so it never moves.
  template <class... BackendArgs>
  explicit Network(std::uint64_t seed = 0, BackendArgs&&... backend_args)
      : backend_(std::forward<BackendArgs>(backend_args)...),
        params_(backend_.template allocate<T>(Body::param_count, MemoryTag::weights)),
        master_(backend_.template allocate<G>(master_weights ? Body::param_count : 0, MemoryTag::weights)),
        grads_(backend_.template allocate<G>(Body::param_count, MemoryTag::gradients)) {
    initialise(seed);
    zero_grad();
  }

  /// Draws the parameters afresh from `seed`; a model split over tensor-parallel ranks takes the
  /// rank's place in its group as `part`, and then holds its part of the whole model's draws (the
  /// constructor draws part 0, which a Network cannot know is wrong).
  void initialise(std::uint64_t seed, int part = 0) {
    Body::init_on(backend_, master_data(), seed, part);
    publish_master();
  }

  Backend& backend() noexcept { return backend_; }
  /// The parameters the layers read (storage precision).
  T* parameter_data() noexcept { return params_.data(); }
  /// The master weights an optimizer updates (compute precision): the parameters themselves unless
  /// the storage is narrower. After updating them, call publish_master().
  G* master_data() noexcept {
    if constexpr (master_weights) return master_.data();
    else return params_.data();
  }
  G* gradient_data() noexcept { return grads_.data(); }
  static std::vector<ParamInfo> parameter_table() { return Body::parameter_table(); }

  /// The parameters, in the compute precision (the master weights).
  std::vector<G> parameters() { return download(master_data()); }
  std::vector<G> gradients() { return download(grads_.data()); }
  void set_parameters(std::span<const G> values) {
    CUPIPE_REQUIRE(index_t(values.size()) == Body::param_count, "set_parameters: got ", values.size(),
                   " values for a model of ", Body::param_count, " parameters");
    backend_.upload(values, master_data());
    publish_master();
  }
  /// The parameters in use become the master weights rounded to the storage precision (nearest
  /// even); nothing to do when they are the same array.
  void publish_master() {
    if constexpr (master_weights)
      convert(backend_, ConstViewOn<Backend, G>{master_.data(), Shape{Body::param_count}},
              ViewOn<Backend, T>{params_.data(), Shape{Body::param_count}});
  }
  void zero_grad() { fill(backend_, ViewOn<Backend, G>{grads_.data(), Shape{Body::param_count}}, G(0)); }

  /// The model's tied copies (GPT-2's wte and lm_head), count 0 when it ties nothing.
  static constexpr TiedCopies tied = Body::tied;
  /// Before an update of a model with tied copies: both copies' gradients become their sum (the
  /// gradient of the one shared tensor). Call once per update, after the last forward_backward; the
  /// pipeline's flush update does the same. Nothing to do for a model without tied copies.
  void sum_tied_gradients() {
    if constexpr (tied.count > 0) {
      const ViewOn<Backend, G> first{grads_.data() + tied.first, Shape{tied.count}};
      const ViewOn<Backend, G> second{grads_.data() + tied.second, Shape{tied.count}};
      axpy(backend_, G(1), ConstViewOn<Backend, G>(second), first);
      copy(backend_, ConstViewOn<Backend, G>(first), second);
    }
  }

  /// Inference: x (n, in_features) -> out (n, out_features), in the backend's memory.
  void forward(ConstViewOn<Backend, input_type> x, ViewOn<Backend, T> out) {
    check_view(out, Shape{x.rows(), out_features}, "Network::forward", "output");
    auto record = backend_.template allocate<T>(Body::record_elements(x.rows()), MemoryTag::activations);
    Body::forward(backend_, params_.data(), x, record.data());
    copy(backend_, ConstViewOn<Backend, T>(Body::template output<typename Backend::space>(record.data(), x.rows())), out);
  }

  /// One forward and backward over x (n, in_features) and labels (n,), both in the backend's memory.
  /// Gradients accumulate (call zero_grad between steps). The loss is divided by `normalizer`
  /// (n when 0). Returns the loss (in the compute precision); throws if it is not finite.
  G forward_backward(ConstViewOn<Backend, input_type> x, ConstViewOn<Backend, std::int32_t> labels, index_t normalizer = 0) {
    const index_t n = x.rows();
    if (normalizer == 0) normalizer = n;
    if (labels.numel() != n)
      CUPIPE_THROW(Loss::describe(), ": expected labels (", n, ",) for input ", x.shape(), " but got labels ", labels.shape());
    backend_.aux_loss_normalizer = normalizer;  // a layer's own auxiliary loss divides by it too (layers/moe.hpp)
    auto record = backend_.template allocate<T>(Body::record_elements(n), MemoryTag::activations);
    auto grad_record = backend_.template allocate<T>(Body::grad_record_elements(n), MemoryTag::activations);
    auto dlogits = backend_.template allocate<T>(n * out_features, MemoryTag::activations);
    Body::forward(backend_, params_.data(), x, record.data());
    const ConstViewOn<Backend, T> logits = Body::template output<typename Backend::space>(record.data(), n);
    const G value = loss_value<Loss>(backend_, logits, labels, normalizer, true);
    Loss::backward(backend_, logits, labels, ViewOn<Backend, T>{dlogits.data(), Shape{n, out_features}}, normalizer);
    Body::backward(backend_, params_.data(), x, record.data(), ConstViewOn<Backend, T>{dlogits.data(), Shape{n, out_features}},
                   ViewOn<Backend, T>{}, grads_.data(), grad_record.data(), true);
    return value;
  }

 private:
  template <class U>
  std::vector<U> download(const U* from) {
    std::vector<U> out(static_cast<std::size_t>(Body::param_count));
    backend_.download(from, std::span<U>(out));
    return out;
  }

  Backend backend_;
  typename Backend::template buffer<T> params_;
  typename Backend::template buffer<G> master_;  ///< empty unless master_weights
  typename Backend::template buffer<G> grads_;
};

}  // namespace cupipe
