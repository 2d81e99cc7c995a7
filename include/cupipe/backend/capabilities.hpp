// SPDX-License-Identifier: Apache-2.0
// What the pipeline runtime needs from a backend, as a concept, and the optional capabilities it may
// use, as a trait whose defaults do nothing. A backend opts in by specialising `capabilities`
// (backend/cuda/cuda.cuh does, for device clocks, NVTX ranges and a second stream); the runtime calls the trait and
// never branches on which backend it runs.
#pragma once

#include <concepts>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "cupipe/core/memory.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe::backend {

/// The operations every backend context provides; ops (gemm, copy, fill, transfer, ...) are free
/// functions found by argument-dependent lookup and checked where a layer calls them.
template <class B>
concept Backend = requires(B& be, const typename B::value_type* from, typename B::value_type* to, index_t n,
                           std::span<typename B::value_type> host, std::span<const typename B::value_type> chost) {
  typename B::value_type;
  typename B::compute_type;
  typename B::template buffer<typename B::value_type>;
  typename B::space;
  { B::name } -> std::convertible_to<std::string_view>;
  { be.memory } -> std::convertible_to<MemoryTracker&>;
  { be.template allocate<typename B::value_type>(n, MemoryTag::activations) }
      -> std::same_as<typename B::template buffer<typename B::value_type>>;
  be.upload(chost, to);
  be.download(from, host);
  be.synchronize();
};

/// No-op scope, for backends without profiler annotations.
struct NoAnnotation {};

/// Optional capabilities, all no-ops by default.
template <class B>
struct capabilities {
  /// A context for `device` (backends without devices ignore it).
  static std::unique_ptr<B> make(int /*device*/) { return std::make_unique<B>(); }
  /// Whether actions are timed on the backend's own clock (device events) rather than the host's.
  static constexpr bool device_timeline = false;
  static void timeline_start(B&) {}
  static int timeline_mark(B&) { return 0; }
  static double timeline_seconds(B&, int) { return 0; }
  /// A profiler range named `label` for as long as the result lives.
  static NoAnnotation annotate(B&, const char*) { return {}; }
  /// An overlapped pair (DualPipeV's F&B): overlap_begin before the first action's work sends it to a
  /// second queue of the same device, after the work enqueued so far; overlap_end sends later work
  /// back, to run beside it; overlap_join makes later work wait for it (and does nothing when no
  /// overlap is open). Backends with one queue run the pair back to back.
  static void overlap_begin(B&) {}
  static void overlap_end(B&) {}
  static void overlap_join(B&) {}
  /// Checks of input the backend can only make on its device (a label or a token id out of range),
  /// which would otherwise wait for the device after the op: defer_input_checks makes the ops only
  /// record what they find and returns what resume_input_checks restores; resume_input_checks, with
  /// `report`, then throws what the deferred ops found (one wait). A pipeline step defers them for
  /// its actions and reports once, before anything is committed. Backends that check on the host
  /// check at once and need neither.
  static bool defer_input_checks(B&) { return false; }
  static void resume_input_checks(B&, bool /*previous*/, bool /*report*/) {}
};

/// capabilities<B>::defer_input_checks where B's specialisation has it (one written before it
/// existed need not), else nothing to defer.
template <class B>
bool defer_input_checks(B& be) {
  if constexpr (requires { capabilities<B>::defer_input_checks(be); }) return capabilities<B>::defer_input_checks(be);
  else return false;
}
/// capabilities<B>::resume_input_checks where B's specialisation has it.
template <class B>
void resume_input_checks(B& be, bool previous, bool report) {
  if constexpr (requires { capabilities<B>::resume_input_checks(be, previous, report); })
    capabilities<B>::resume_input_checks(be, previous, report);
}

}  // namespace cupipe::backend
