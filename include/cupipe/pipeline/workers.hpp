// SPDX-License-Identifier: Apache-2.0
// The workers' backends. A pipeline names one backend for all of its workers (Pipeline<Stages,
// Schedule, backend::Host<float>>), or one per worker (backend::PerWorker<Host<float>, Cuda<bfloat16,
// float>>, backend/per_worker.hpp): stages of different precisions and memory spaces in one pipeline, each hand-over
// converting and copying between them (pipeline/hand_over.hpp). Workers<Spec, N> owns the contexts of
// this process's workers and reaches worker w's as its own type, by a compile-time index or by a
// visit with a run-time one.
#pragma once

#include <cstddef>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cupipe/backend/capabilities.hpp"
#include "cupipe/backend/per_worker.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe::pipeline {

/// What a pipeline's backend argument says of each worker: `at<W>` is worker W's backend type;
/// `mixed` whether they differ; `count` the workers it names (0: any number).
template <class Spec>
struct worker_backends {
  static_assert(backend::Backend<Spec>, "Pipeline: the backend argument must be a backend (backend::Host<float>, "
                                        "backend::Cuda<float>, ...) or backend::PerWorker<one backend per worker>");
  static constexpr bool mixed = false;
  static constexpr std::size_t count = 0;
  template <int W>
  using at = Spec;
  using uniform = Spec;
};
template <class B0, class... Bs>
struct worker_backends<backend::PerWorker<B0, Bs...>> {
  static constexpr bool mixed = !(std::is_same_v<B0, Bs> && ...);
  static constexpr std::size_t count = 1 + sizeof...(Bs);
  template <int W>
  using at = std::tuple_element_t<std::size_t(W), std::tuple<B0, Bs...>>;
  using uniform = std::conditional_t<mixed, void, B0>;
};

/// The contexts of N workers: null where another process runs the worker.
template <class Spec, int N>
class Workers;

/// One backend for every worker: a vector of contexts.
template <class Spec, int N>
  requires(!worker_backends<Spec>::mixed)
class Workers<Spec, N> {
  static_assert(worker_backends<Spec>::count == 0 || worker_backends<Spec>::count == std::size_t(N),
                "Pipeline: backend::PerWorker names one backend per worker (physical stage); its count differs from "
                "the pipeline's workers");

 public:
  using Backend = typename worker_backends<Spec>::uniform;
  template <int W>
  using backend = Backend;
  static constexpr bool mixed = false;

  Workers() : owned_(std::size_t(N)), pointers_(std::size_t(N), nullptr) {}

  /// Makes worker w's context for `device` (backends without devices ignore it).
  void make(int w, int device) {
    owned_[std::size_t(w)] = ::cupipe::backend::capabilities<Backend>::make(device);
    pointers_[std::size_t(w)] = owned_[std::size_t(w)].get();
  }
  bool present(int w) const { return pointers_.at(std::size_t(w)) != nullptr; }
  template <int W>
  Backend* get() const {
    return pointers_[std::size_t(W)];
  }
  Backend& operator[](int w) const { return *pointers_.at(std::size_t(w)); }
  /// f(w, context) for every worker of this process.
  template <class F>
  void for_each(F&& f) const {
    for (int w = 0; w < N; ++w)
      if (pointers_[std::size_t(w)]) f(w, *pointers_[std::size_t(w)]);
  }
  /// f(context of worker w); w must run in this process.
  template <class F>
  decltype(auto) visit(int w, F&& f) const {
    return f(*pointers_[std::size_t(w)]);
  }
  const std::vector<Backend*>& pointers() const noexcept { return pointers_; }
  MemoryTracker& memory(int w) const { return (*this)[w].memory; }

 private:
  std::vector<std::unique_ptr<Backend>> owned_;
  std::vector<Backend*> pointers_;
};

/// A backend per worker: a tuple of contexts, each its own type.
template <class Spec, int N>
  requires(worker_backends<Spec>::mixed)
class Workers<Spec, N> {
  using spec = worker_backends<Spec>;
  static_assert(spec::count == std::size_t(N), "Pipeline: backend::PerWorker names one backend per worker (physical "
                                               "stage); its count differs from the pipeline's workers");
  template <std::size_t... W>
  static auto tuple_of(std::index_sequence<W...>) -> std::tuple<std::unique_ptr<typename spec::template at<int(W)>>...>;
  // A function, not a lambda in the initialiser: nvcc's host pass loses the lambda's template parameter.
  template <std::size_t... W>
  static constexpr bool all_host(std::index_sequence<W...>) {
    return (host_accessible<typename spec::template at<int(W)>::space> && ...);
  }

 public:
  template <int W>
  using backend = typename spec::template at<W>;
  static constexpr bool mixed = true;
  /// Whether every worker's memory is host memory (no device backend among them).
  static constexpr bool host_only = all_host(std::make_index_sequence<std::size_t(N)>());

  void make(int w, int device) {
    each([&]<int W>(std::integral_constant<int, W>) {
      if (W == w) std::get<W>(owned_) = ::cupipe::backend::capabilities<backend<W>>::make(device);
    });
  }
  bool present(int w) const {
    bool here = false;
    each([&]<int W>(std::integral_constant<int, W>) {
      if (W == w) here = std::get<W>(owned_) != nullptr;
    });
    return here;
  }
  template <int W>
  backend<W>* get() const {
    return std::get<W>(owned_).get();
  }
  template <class F>
  void for_each(F&& f) const {
    each([&]<int W>(std::integral_constant<int, W>) {
      if (auto* be = std::get<W>(owned_).get()) f(W, *be);
    });
  }
  /// f(context of worker w), which must run in this process; f returns the same type for every worker.
  template <class F>
  decltype(auto) visit(int w, F&& f) const {
    CUPIPE_REQUIRE(w >= 0 && w < N && present(w), "Pipeline: worker ", w, " has no context in this process");
    return visit_from<0>(w, f);
  }
  MemoryTracker& memory(int w) const {
    return visit(w, [](auto& be) -> MemoryTracker& { return be.memory; });
  }

 private:
  template <class F>
  static void each(F&& f) {
    [&]<std::size_t... W>(std::index_sequence<W...>) {
      (f(std::integral_constant<int, int(W)>{}), ...);
    }(std::make_index_sequence<std::size_t(N)>());
  }
  template <int W, class F>
  decltype(auto) visit_from(int w, F& f) const {
    if constexpr (W + 1 == N) return f(*std::get<W>(owned_));
    else if (w == W) return f(*std::get<W>(owned_));
    else return visit_from<W + 1>(w, f);
  }

  decltype(tuple_of(std::make_index_sequence<std::size_t(N)>())) owned_;
};

}  // namespace cupipe::pipeline
