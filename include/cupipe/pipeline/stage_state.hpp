// SPDX-License-Identifier: Apache-2.0
// StageState: everything one virtual stage keeps between actions and steps on its worker: weight
// versions, accumulated gradients, optimizer slots, and the microbatches it holds between F and B/W.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "cupipe/core/memory.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/pipeline/activation_arena.hpp"
#include "cupipe/pipeline/in_flight_table.hpp"
#include "cupipe/pipeline/versioned_weights.hpp"

namespace cupipe::pipeline {

/// ZeRO (PipelineOptions::zero): the part of a stage's flat parameters whose optimizer state (with
/// ZeRO-2 also summed gradients, with ZeRO-3 also weights) one replica keeps and updates. Replica r
/// of R holds [r x stride, (r + 1) x stride) clipped to the
/// parameters, stride = ceil(parameters / R), so the shards lie back to back in the flat layout and a
/// gather of R blocks of `stride` values rebuilds it. Without ZeRO the shard is everything.
struct Shard {
  index_t begin = 0;
  index_t end = 0;
  index_t stride = 0;
  int replicas = 1;

  static Shard whole(index_t params) noexcept { return {0, params, params, 1}; }
  static Shard of(index_t params, int replicas, int replica) noexcept {
    const index_t stride = (params + replicas - 1) / replicas;
    const index_t begin = std::min(params, stride * replica);
    return {begin, std::min(params, begin + stride), stride, replicas};
  }
  index_t size() const noexcept { return end - begin; }
  bool sharded() const noexcept { return replicas > 1; }
};

template <class Seq, class Backend, int MaxVersions>
struct StageState {
  using backend_type = Backend;
  using T = typename Backend::value_type;  ///< storage: weights in use, activations, messages
  using G = grad_t<Backend>;               ///< compute: gradients, master weights, optimizer state
  using buffer = typename Backend::template buffer<T>;
  using grad_buffer = typename Backend::template buffer<G>;
  /// Whether the weights in use are a rounding of float master weights (bf16 storage).
  static constexpr bool master_weights = !std::is_same_v<T, G>;
  static constexpr index_t param_count = Seq::param_count;

  using slot = ArenaSlot<buffer>;

  /// What a microbatch leaves on the stage between its forward and its backward (or W).
  struct InFlight {
    index_t rows = 0;
    int version = 0;
    buffer input;      // received activation (empty on virtual stage 0: the batch rows are used)
    slot record;       // what backward needs
    slot grad_record;  // per-layer output gradients, kept for W
    slot dy;           // incoming gradient (the loss's on the last stage), kept for W
  };

  StageState(Backend& backend, int allowed_versions, bool recompute_)
      : be(&backend),
        weights(backend, param_count, allowed_versions),
        grads(backend.template allocate<G>(param_count, MemoryTag::gradients)),
        master(backend.template allocate<G>(master_weights ? param_count : 0, MemoryTag::weights)),
        recompute(recompute_) {
    zero_grads();
  }

  ViewOn<Backend, G> grad_view() { return {grads.data(), Shape{param_count}}; }
  /// Zeroes the gradients: the whole buffer where it is held, and the summed shard with ZeRO-2.
  void zero_grads() {
    if (grads.size() > 0) fill(*be, grad_view(), G(0));
    if (grad_shard.size() > 0) fill(*be, ViewOn<Backend, G>{grad_shard.data(), Shape{grad_shard.size()}}, G(0));
  }

  /// ZeRO-2 (the shard set first): the stage keeps its summed gradients as this replica's shard
  /// only, in `grad_shard`; the whole buffer a backward accumulates into is held from the step's
  /// first gradient action until its reduce-scatter (pipeline/gradient_shards.hpp), and released.
  void shard_gradients() {
    sharded_grads = true;
    grads = grad_buffer();
    grad_shard = be->template allocate<G>(shard.size(), MemoryTag::gradients);
    zero_grads();
  }
  /// The whole gradient buffer a backward accumulates into, allocated (zeroed) where ZeRO-2
  /// released it: replicas x stride values, so that the reduce-scatter runs in place on it.
  G* gradients() {
    if (grads.size() == 0 && sharded_grads) {
      grads = be->template allocate<G>(shard.stride * shard.replicas, MemoryTag::gradients);
      fill(*be, ViewOn<Backend, G>{grads.data(), Shape{grads.size()}}, G(0));
    }
    return grads.data();
  }
  /// Whether the whole gradient buffer is held (always, unless ZeRO-2 released it).
  bool holds_gradients() const { return grads.size() > 0; }
  /// This replica's shard of the gradients (shard.size() values): the summed shard with ZeRO-2,
  /// else the shard's part of the whole buffer (summed there by ZeRO-1's reduce-scatter).
  G* shard_gradient_data() { return sharded_grads ? grad_shard.data() : grads.data() + shard.begin; }

  /// ZeRO-3 (the shard set first, the weights initialised): the stage keeps this replica's shard of
  /// its (master) weights only, in `param_shard`, in the compute type; the whole weights in use are
  /// released, to be gathered over the replicas where an action needs them
  /// (pipeline/parameter_shards.hpp), and the master weights go.
  void shard_parameters() {
    param_shard = be->template allocate<G>(shard.size(), MemoryTag::weights);
    if (shard.size() > 0)
      copy(*be, ConstViewOn<Backend, G>{master_data() + shard.begin, Shape{shard.size()}},
           ViewOn<Backend, G>{param_shard.data(), Shape{shard.size()}});
    be->synchronize();
    sharded_params = true;
    master = grad_buffer();
    weights.release();
  }
  /// ZeRO-3: releases the gathered whole weights, once the backend's queued work no longer reads them.
  void drop_weights() {
    if (!weights.held()) return;
    be->synchronize();
    weights.release();
  }
  /// This replica's shard of the values an optimizer updates, `params` being the whole weights the
  /// update is for (a version of them): the ZeRO-3 shard, else the shard's part of the master
  /// weights (bf16 storage) or of `params`.
  G* shard_parameter_data(T* params) {
    if (sharded_params) return param_shard.data();
    if constexpr (master_weights) return master.data() + shard.begin;
    else return params + shard.begin;
  }

  /// The weights an optimizer updates and a checkpoint stores: the float master weights with bf16
  /// storage, else the latest version itself. Not with ZeRO-3 (param_shard holds them, sharded).
  G* master_data() {
    if constexpr (master_weights) return master.data();
    else return weights.latest_data();
  }
  /// Values [begin, end) of the weights at `to` become the master weights' rounding (nearest even);
  /// nothing to do without master weights.
  void publish_master(T* to, index_t begin = 0, index_t end = param_count) {
    if constexpr (master_weights)
      if (end > begin)
        convert(*be, ConstViewOn<Backend, G>{master.data() + begin, Shape{end - begin}}, ViewOn<Backend, T>{to + begin, Shape{end - begin}});
  }

  Backend* be;
  VersionedWeights<Backend, MaxVersions> weights;
  grad_buffer grads;  ///< the whole stage's; with ZeRO-2 held only within a step (gradients())
  grad_buffer grad_shard;      ///< ZeRO-2: this replica's shard of the summed gradients; else empty
  bool sharded_grads = false;  ///< ZeRO-2 (shard_gradients)
  grad_buffer master;  ///< empty unless master_weights (and not with ZeRO-3)
  grad_buffer param_shard;      ///< ZeRO-3: this replica's shard of the (master) weights; else empty
  bool sharded_params = false;  ///< ZeRO-3 (shard_parameters)
  std::vector<G> gathering;     ///< ZeRO-3: the host buffer of a prefetched gather in flight; else empty
  Shard shard = Shard::whole(param_count);  ///< the parameters this replica's optimizer state covers
  std::vector<grad_buffer> slots;  ///< optimizer state, one array per slot, shard.size() values each
  std::string slots_for;      ///< the optimizer the slots belong to
  std::int64_t updates = 0;
  /// Post-validation: master weights, gradients and slots before the last update made without the
  /// global norm, and the update count then (pipeline::save_for_rollback); empty otherwise.
  std::vector<grad_buffer> saved;
  std::int64_t saved_updates = 0;
  bool recompute = false;     ///< keep only the input after F; B recomputes the record
  InFlightTable<InFlight> in_flight;
  ActivationArena<Backend> arena;  ///< where a laid-out step's InFlight buffers live
  /// [microbatch] the host copies of offloaded records (PipelineOptions::offload), kept from step
  /// to step so that a steady run allocates none.
  std::vector<HostBuffer<T>> offloaded;
  std::vector<char> done;          ///< per microbatch of the running step
  std::vector<int> done_in_batch;  ///< per batch of the running step
};

}  // namespace cupipe::pipeline
