// SPDX-License-Identifier: Apache-2.0
// Applying an optimizer to stage states: its state slots, one stage's update from its gradients, the
// sum of a stage's gradients over its data-parallel replicas, and the flush update with the global
// gradient norm summed over every stage.
#pragma once

#include <cmath>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/layers/sequential.hpp"
#include "cupipe/optim/optimizers.hpp"

namespace cupipe::pipeline {

/// Allocates (zeroed) the optimizer's state slots of a stage, unless it already has them.
template <class Optimizer, class St>
void prepare_slots(St& st) {
  using B = std::remove_reference_t<decltype(*st.be)>;
  using T = typename B::value_type;
  if (st.slots_for == Optimizer::name && st.slots.size() == Optimizer::slot_names.size()) return;
  st.slots.clear();
  for (std::size_t i = 0; i < Optimizer::slot_names.size(); ++i) {
    st.slots.push_back(st.be->template allocate<T>(st.param_count, MemoryTag::optimizer));
    fill(*st.be, ViewOn<B, T>{st.slots.back().data(), Shape{st.param_count}}, T(0));
  }
  st.slots_for = std::string(Optimizer::name);
}

/// Updates `params` (one of the stage's weight versions) from the stage's gradients scaled by
/// `grad_scale`, then zeroes the gradients.
template <class Optimizer, class St, class T>
void update_stage(St& st, T* params, const Optimizer& optimizer, double grad_scale) {
  using B = std::remove_reference_t<decltype(*st.be)>;
  std::vector<ViewOn<B, T>> slots;
  for (auto& s : st.slots) slots.push_back({s.data(), Shape{st.param_count}});
  optimizer.update(*st.be, ViewOn<B, T>{params, Shape{st.param_count}}, ConstViewOn<B, T>(st.grad_view()),
                   std::span<const ViewOn<B, T>>(slots), st.updates, grad_scale);
  st.zero_grads();
  ++st.updates;
}

/// Sum of squares of a stage's gradients.
template <class St>
double gradient_sum_of_squares(St& st) {
  using B = std::remove_reference_t<decltype(*st.be)>;
  return sum_of_squares(*st.be, ConstViewOn<B, typename B::value_type>(st.grad_view()));
}

/// Sums a stage's gradients over its replicas (through host memory unless the communicator takes
/// the backend's memory). Nothing to do without replicas.
template <class St>
void sum_over_replicas(comm::Communicator* comm, St& st) {
  if (!comm || comm->topology().replicas == 1) return;
  using Backend = std::remove_reference_t<decltype(*st.be)>;
  using T = typename Backend::value_type;
  st.be->synchronize();
  if (comm::reads_backend_memory<Backend>(*comm)) {
    comm->sum_over_replicas(st.grads.data(), std::size_t(st.param_count));
    return;
  }
  std::vector<T> host(static_cast<std::size_t>(st.param_count));
  st.be->download(st.grads.data(), std::span<T>(host));
  comm->sum_over_replicas(host.data(), host.size());
  st.be->upload(std::span<const T>(host), st.grads.data());
}

/// Replaces the gradients of both tied copies (in the whole model's flat layout) by their sum, on
/// whichever local stages hold them; across processes every rank of the pipeline adds its part (zeros
/// where it holds neither) in one sum over the stages. Returns this process's share of the sum of
/// squares to leave out of the gradient norm (the second copy's, where it is held here), so the
/// shared tensor counts once, as PyTorch counts a tied parameter.
template <class States>
double sum_tied_gradients(States& states, comm::Communicator* comm, const TiedCopies& tied) {
  using T = typename States::T;
  std::vector<T> sum(static_cast<std::size_t>(tied.count), T(0)), part(sum.size());
  auto each_copy = [&](auto&& f) {
    states.for_each([&](auto k, auto& st) {
      constexpr index_t offset = States::template model_offset<decltype(k)::value>();
      for (const index_t at : {tied.first, tied.second})
        if (at >= offset && at + tied.count <= offset + st.param_count) f(st, st.grads.data() + (at - offset), at == tied.second);
    });
  };
  each_copy([&](auto& st, T* grads, bool) {
    st.be->download(grads, std::span<T>(part));
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
  });
  if (comm && comm->topology().stages > 1) comm->sum_over_stages(sum.data(), sum.size());
  double excluded = 0;
  each_copy([&](auto& st, T* grads, bool second) {
    st.be->upload(std::span<const T>(sum), grads);
    if (second)
      for (T g : sum) excluded += double(g) * double(g);
  });
  return excluded;
}

/// The flush update: the tied copies' gradients summed, the global gradient norm over every stage
/// (and process), one clip factor, then every local stage steps. Returns the norm before clipping.
template <class Optimizer, class States>
double flush_update(States& states, comm::Communicator* comm, const Optimizer& optimizer, const TiedCopies& tied = {}) {
  double sum = 0;
  if (tied.count > 0) sum -= sum_tied_gradients(states, comm, tied);
  states.for_each([&](auto, auto& st) { sum += gradient_sum_of_squares(st); });
  if (comm) sum = comm->sum_over_stages(sum);  // replicas hold the same summed gradients
  const double norm = std::sqrt(sum);
  const double scale = optim::clip_factor(norm, optimizer.clip_norm());
  states.for_each([&](auto, auto& st) { update_stage(st, st.weights.latest_data(), optimizer, scale); });
  return norm;
}

}  // namespace cupipe::pipeline
