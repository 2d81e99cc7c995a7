// SPDX-License-Identifier: Apache-2.0
// PipelineChecks: everything a Pipeline refuses before it runs, each with the sentence that says
// why and what to change: the options against the schedule and the model, the communicator's
// topology, tensor parallelism, a backend per worker, post-validation, ZeRO-1, a user's plan, the
// settings every rank must share, and the shapes of a batch or a prediction. Also makes the plan a
// pipeline runs (the policy's, or PipelineOptions::plan), verified.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "cupipe/comm/agreement.hpp"
#include "cupipe/comm/communicator.hpp"
#include "cupipe/core/dtype.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/pipeline/context_parallel.hpp"
#include "cupipe/pipeline/expert_parallel.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/layers/tensor_parallel.hpp"
#include "cupipe/pipeline/batch_values.hpp"
#include "cupipe/pipeline/options.hpp"
#include "cupipe/schedule/fingerprint.hpp"
#include "cupipe/schedule/policy.hpp"
#include "cupipe/schedule/verify.hpp"

namespace cupipe::pipeline {

template <class Stages, class Schedule, class Executor>
struct PipelineChecks {
  using Model = typename Stages::model;
  using States = typename Executor::States;
  static constexpr int virtual_stages = Executor::virtual_stages, stages = Executor::workers, chunks = Schedule::chunks;
  static constexpr bool flush = Schedule::update == schedule::UpdateRule::flush;
  static constexpr TiedCopies tied = Model::body::tied;

  /// The options on their own and against the schedule and the model.
  static void options(const PipelineOptions& o) {
    CUPIPE_REQUIRE(o.microbatches >= 1, "Pipeline: microbatches must be at least 1, got ", o.microbatches);
    CUPIPE_REQUIRE(o.batches >= 0, "Pipeline: batches must not be negative, got ", o.batches);
    if constexpr (tied.count > 0 && !flush)
      CUPIPE_THROW("Pipeline: ", Schedule::name, " updates each stage on its own, but this model ties a layer to its "
                   "input embedding (as GPT-2 ties lm_head to wte); tied copies are summed by a flush update, so use a "
                   "flush schedule or untie them (gpt::Config::tied = false)");
    if (flush && o.batches > 1)
      CUPIPE_THROW("Pipeline: ", Schedule::name, " flushes after every batch, so batches must be 1, got ", o.batches);
    CUPIPE_REQUIRE(o.devices.empty() || int(o.devices.size()) == stages, "Pipeline: ", o.devices.size(),
                   " devices given for ", stages, " stages");
    for (int k : o.recompute)
      CUPIPE_REQUIRE(k >= 0 && k < virtual_stages, "Pipeline: recompute names stage ", k, " but there are ",
                     virtual_stages, " (virtual) stages");
    for (int k : o.offload) {
      CUPIPE_REQUIRE(k >= 0 && k < virtual_stages, "Pipeline: offload names stage ", k, " but there are ",
                     virtual_stages, " (virtual) stages");
      CUPIPE_REQUIRE(std::find(o.recompute.begin(), o.recompute.end(), k) == o.recompute.end(), "Pipeline: stage ", k,
                     " both recomputes and offloads its records; a recomputing stage keeps none to offload");
    }
    CUPIPE_REQUIRE(o.offload_resident >= 1, "Pipeline: offload_resident must be at least 1 record per stage, got ",
                   o.offload_resident);
  }

  /// The stage this process runs (-1: all of them), from the communicator's topology.
  static int local_worker(comm::Communicator* comm) {
    if (!comm) return -1;
    const comm::Topology& topology = comm->topology();
    if (topology.stages != stages)
      CUPIPE_THROW("Pipeline: the communicator splits the world into ", topology.stages, " stages but this pipeline has ",
                   stages);
    return topology.stage();
  }

  /// A model split over tensor-parallel ranks runs across processes whose communicator has as many
  /// per stage, under a flush schedule (its global norm is the whole model's, so every rank of a
  /// group clips alike). Returns the stage's group, or null without tensor parallelism.
  /// With experts split over an expert-parallel group (pipeline/expert_parallel.hpp), that group,
  /// which plays the same part for the split tensors.
  static TensorGroup* tensor_group(comm::Communicator* comm) {
    if (moe::ExpertGroup* experts = expert_group_for(comm, Model::parameter_table())) {
      if (!flush)
        CUPIPE_THROW("Pipeline: expert parallelism needs a flush schedule (the experts' gradient norm is the whole "
                     "model's), but ", Schedule::name, " updates each stage on its own");
      return experts;
    }
    const int parts = layers::tensor_parallel::parts_of(Model::parameter_table());
    const int ranks = comm ? comm->topology().tensor : 1;
    if (parts == 1 && ranks == 1) return nullptr;
    if (parts != ranks)
      CUPIPE_THROW("Pipeline: the model's layers are split over ", parts, " tensor-parallel rank(s), but ",
                   comm ? "the communicator has " + std::to_string(ranks) + " per stage"
                        : std::string("there is no communicator (make one with that many: comm::MpiCommunicator(world, "
                                      "stages, timeout, tensor))"));
    if (!flush)
      CUPIPE_THROW("Pipeline: tensor parallelism needs a flush schedule (its gradient norm is the whole model's), but ",
                   Schedule::name, " updates each stage on its own");
    TensorGroup* group = comm->tensor_group();
    CUPIPE_REQUIRE(group && group->size() == parts, "Pipeline: the communicator gives no tensor group of ", parts,
                   " ranks");
    return group;
  }

  /// A pipeline with a backend per worker: one process, no post-validation, and tied copies (GPT-2's
  /// wte and lm_head) only on workers of one backend type.
  static void mixed(const PipelineOptions& o, States& states) {
    if (o.communicator)
      CUPIPE_THROW("Pipeline: a pipeline with a backend per worker (backend::PerWorker) runs every stage in one "
                   "process; across processes give every rank the same backend (leave the communicator out)");
    if (o.post_validation)
      CUPIPE_THROW("Pipeline: post_validation is not supported with a backend per worker (backend::PerWorker) yet; "
                   "leave it off");
    if constexpr (tied.count > 0) {
      std::string holders[2], labels[virtual_stages];
      states.for_each_slot([&](auto k, auto&) {
        constexpr int K = decltype(k)::value;
        labels[K] = backend_label<typename Executor::Contexts::template backend<Executor::worker_at(K)>>();
      });
      const std::array<int, 2> at = tied_holders(states);
      for (int c = 0; c < 2; ++c) holders[c] = at[std::size_t(c)] < 0 ? "" : labels[at[std::size_t(c)]];
      if (holders[0] != holders[1])
        CUPIPE_THROW("Pipeline: this model ties two copies of a parameter (GPT-2's wte and lm_head), held by workers of "
                     "different backends (", holders[0], " and ", holders[1], "); their gradients are summed as one "
                     "tensor, so give those workers one backend, or untie the copies (gpt::Config::tied = false)");
    }
  }

  /// PipelineOptions::post_validation needs a flush schedule, every stage here, and tied copies on one
  /// worker (their gradients are summed before the norm, by the worker that holds both). Returns that
  /// worker (-1: no tied copies).
  static int post_validation(const PipelineOptions& o, States& states) {
    if (!flush)
      CUPIPE_THROW("Pipeline: post_validation checks a flush update's global gradient norm, but ", Schedule::name,
                   " updates each stage on its own; it has no flush to take off the critical path");
    if (o.communicator)
      CUPIPE_THROW("Pipeline: post_validation runs every stage in one process; across processes the norm would need a "
                   "non-blocking sum, which the communicators do not offer yet (leave post_validation off)");
    int holder[2] = {-1, -1};
    if constexpr (tied.count > 0) {
      const std::array<int, 2> at = tied_holders(states);
      for (int c = 0; c < 2; ++c) holder[c] = at[std::size_t(c)] < 0 ? -1 : Executor::worker_at(at[std::size_t(c)]);
      if (holder[0] != holder[1])
        CUPIPE_THROW("Pipeline: post_validation: this model ties two copies of a parameter (GPT-2's wte and lm_head), "
                     "held by workers ", holder[0], " and ", holder[1], " under ", Schedule::name,
                     "; their gradients are summed before the norm, which needs both on one worker. Use a V-shaped "
                     "schedule (zbv, v-half, v-min, dualpipev: both ends on worker 0) or untie them");
    }
    return holder[0];
  }

  /// PipelineOptions::zero's conditions; `sharded`: whether there are replicas to shard over.
  static void zero(const PipelineOptions& o, bool sharded) {
    if (o.zero < 0 || o.zero > 3)
      CUPIPE_THROW("Pipeline: zero is the ZeRO stage, 0 (off), 1 (optimizer state), 2 (and gradients) or 3 (and "
                   "parameters), got ", o.zero);
    if (sharded && o.zero >= 2 && !o.communicator->reduce_scatters())
      CUPIPE_THROW("Pipeline: zero = ", o.zero, " reduce-scatters the gradients over the replicas, which this "
                   "communicator cannot do (MpiCommunicator and NcclCommunicator can); use zero = 1");
    if (!flush)
      CUPIPE_THROW("Pipeline: zero shards the optimizer state of a flush update over the replicas, but ", Schedule::name,
                   " updates each stage inside the step (use a flush schedule, or leave zero off)");
    if (o.communicator && o.communicator->expert_group())
      CUPIPE_THROW("Pipeline: zero shards every tensor over all the stage's replicas, but under expert parallelism the "
                   "experts' tensors differ between the replicas of a group; leave zero off");
    if (o.post_validation)
      CUPIPE_THROW("Pipeline: zero and post_validation cannot be combined yet (post-validation keeps a whole copy of "
                   "the optimizer state to roll back to); leave one of them off");
    if (sharded && !o.communicator->all_gathers())
      CUPIPE_THROW("Pipeline: zero gathers the updated parameter shards over the replicas, which this communicator "
                   "cannot do (MpiCommunicator and NcclCommunicator can); leave zero off");
  }

  /// The ZeRO setting every rank must share (ZeRO-3's gathers follow reshard_after_forward).
  static std::string zero_text(const PipelineOptions& o) {
    if (!o.zero) return "off";
    return "stage " + std::to_string(o.zero) +
           (o.zero == 3 ? (o.reshard_after_forward ? ", resharded after each action" : ", kept through the step") : "");
  }

  /// The plan the pipeline runs, verified: the policy's, or PipelineOptions::plan for a UserPlan.
  /// Across processes every rank must run the same plan: ranks started with another schedule,
  /// microbatch count, seed or plan file fail here, every one of them, naming the setting (rather
  /// than waiting on a message that never comes). A collective, before any other.
  static schedule::Plan plan(const PipelineOptions& o) {
    schedule::Plan plan;
    if constexpr (requires { Schedule::from_options; }) plan = user_plan(o);
    else {
      CUPIPE_REQUIRE(!o.plan, "Pipeline: PipelineOptions::plan is set, but ", Schedule::name,
                     " makes its own plan; run a plan from a file with schedule::UserPlan");
      plan = schedule::generate<Schedule>({stages, o.microbatches, chunks, std::max(o.batches, 1)});
    }
    if (const auto verdict = schedule::verify(plan); !verdict)
      CUPIPE_THROW("Pipeline: the ", Schedule::name, " plan failed verification: ", verdict.message());
    if constexpr (Executor::Contexts::mixed) {
      if constexpr (!Executor::Contexts::host_only)
        for (const auto& actions : plan.actions)
          for (const schedule::Action& a : actions)
            if (a.overlap)
              CUPIPE_THROW("Pipeline: ", Schedule::name, " overlaps F&B pairs on a second stream, which a pipeline "
                           "with a device worker among backends of several types (backend::PerWorker) does not "
                           "support yet (a hand-over from another backend copies on the receiver's stream from the "
                           "sender's thread); use another schedule");
    }
    comm::Communicator* comm = o.communicator.get();
    if (comm && comm->topology().world > 1)
      comm::require_same_settings(*comm, {{"schedule", std::string(Schedule::name)},
                                          {"microbatches", std::to_string(o.microbatches)},
                                          {"seed", std::to_string(o.seed)},
                                          {"zero", zero_text(o)},
                                          {"tensor-parallel ranks", std::to_string(comm->topology().tensor)},
                                          {"hand-over", wires_text(o.hand_over)},
                                          {"packed sequences", o.packed_sequences ? "on" : "off"},
                                          {"plan fingerprint", schedule::fingerprint(plan)}});
    if (o.channel_capacity > 0 && o.channel_capacity < std::size_t(plan.channel_depth))
      CUPIPE_THROW("Pipeline: channel_capacity ", o.channel_capacity, " is below the ", plan.channel_depth,
                   " messages the ", Schedule::name, " plan queues on one channel (", o.microbatches,
                   " microbatches); raise it or leave it 0");
    return plan;
  }

  /// Shapes and pointers of a batch, in whichever memory it is, split into `parts` microbatches; in
  /// host memory also its labels and token ids (pipeline/batch_values.hpp).
  template <class Space>
  static void batch(TensorView<const typename Executor::input_type, Space> x, TensorView<const std::int32_t, Space> labels,
                    std::string_view who, pipeline::BatchSplit split) {
    const index_t n = x.rows();
    check_view(x, Shape{n, Stages::in_features}, who, "input batch");
    if (labels.numel() != n)
      CUPIPE_THROW(Stages::loss::describe(), ": expected labels (", n, ",) for the input batch ", x.shape(),
                   " but got labels ", labels.shape());
    check_view(labels, labels.shape(), who, "labels");
    if constexpr (host_accessible<Space>)
      check_batch_values<Stages, typename Executor::input_type>(x, labels, who, split.parts, split.rows_per_sample);
  }
  /// An input of whole samples and an output (rows, `features`) for Pipeline::predict.
  template <class Space, class T>
  static void prediction(TensorView<const typename Executor::input_type, Space> x, const TensorView<T, Space>& out,
                         index_t features, index_t rows_per_sample) {
    CUPIPE_REQUIRE(x.rows() > 0, "Pipeline::predict: the input has 0 rows; there is nothing to predict");
    check_view(x, Shape{x.rows(), Stages::in_features}, "Pipeline::predict", "input");
    if (x.rows() % rows_per_sample != 0)
      CUPIPE_THROW("Pipeline::predict: the input's ", x.rows(), " rows are not whole samples of ", rows_per_sample,
                   " rows (the model's sequences, or this rank's share of each under context parallelism)");
    check_view(out, Shape{x.rows(), features}, "Pipeline::predict", "output");
  }

 private:
  /// The virtual stage that holds the whole of each tied copy (-1: none does).
  static std::array<int, 2> tied_holders(States& states) {
    std::array<int, 2> holder{-1, -1};
    states.for_each_slot([&](auto k, auto&) {
      constexpr int K = decltype(k)::value;
      constexpr index_t offset = States::template model_offset<K>(), count = Stages::template stage<K>::param_count;
      for (int c = 0; c < 2; ++c) {
        const index_t at = c == 0 ? tied.first : tied.second;
        if (at >= offset && at + tied.count <= offset + count) holder[std::size_t(c)] = K;
      }
    });
    return holder;
  }

  /// The plan of PipelineOptions::plan, checked against what this pipeline was compiled for.
  static schedule::Plan user_plan(const PipelineOptions& o) {
    CUPIPE_REQUIRE(o.plan, "Pipeline: a UserPlan pipeline runs PipelineOptions::plan, which is not set (read a "
                           "plan with io::load_plan)");
    const schedule::Plan& p = *o.plan;
    const schedule::Config& c = p.config;
    if (c.stages != stages || c.chunks != chunks || c.microbatches != o.microbatches || c.batches != 1)
      CUPIPE_THROW("Pipeline: the plan is for stages ", c.stages, ", chunks ", c.chunks, ", microbatches ", c.microbatches,
                   ", batches ", c.batches, " but this pipeline has stages ", stages, ", chunks ", chunks,
                   ", microbatches ", o.microbatches, ", batches 1");
    if (p.split_backward != Schedule::split_backward)
      CUPIPE_THROW("Pipeline: the plan ", p.split_backward ? "splits" : "does not split",
                   " the backward into B and W, but the pipeline's UserPlan type says the opposite");
    if (p.update != schedule::UpdateRule::flush)
      CUPIPE_THROW("Pipeline: a UserPlan runs flush updates only, but the plan's update rule is not flush");
    if (!(p.placement == Schedule::placement(c)))
      CUPIPE_THROW("Pipeline: the plan places its virtual stages differently from the pipeline's UserPlan type "
                   "(looped or V-shaped)");
    return p;
  }

  /// "host<bfloat16, float>": a backend's name and precisions, for messages.
  template <class B>
  static std::string backend_label() {
    std::string label = std::string(B::name) + "<" + std::string(name(dtype_v<typename B::value_type>));
    if constexpr (!std::is_same_v<typename B::value_type, grad_t<B>>) label += ", " + std::string(name(dtype_v<grad_t<B>>));
    return label + ">";
  }
};

}  // namespace cupipe::pipeline
