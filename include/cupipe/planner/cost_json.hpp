// SPDX-License-Identifier: Apache-2.0
// A cost model as JSON: what `cupipe_plan --write-costs` writes and `--costs` reads, and how a
// trainer's first rank hands the model it measured to the other ranks (--plan auto under mpirun),
// so that every rank plans from the same numbers and chooses the same layout. Doubles are written
// with enough digits to read back exactly.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cupipe/core/error.hpp"
#include "cupipe/planner/planner.hpp"

namespace cupipe::planner {

namespace detail {
inline nlohmann::json layers_json(const std::vector<LayerCost>& list) {
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerCost& l : list)
    layers.push_back({{"name", l.name}, {"forward", l.forward}, {"backward_input", l.backward_input},
                      {"backward_weight", l.backward_weight}, {"params", l.params}, {"in", l.in}, {"out", l.out},
                      {"saved", l.saved}, {"forward_fixed", l.forward_fixed}, {"backward_input_fixed", l.backward_input_fixed},
                      {"backward_weight_fixed", l.backward_weight_fixed}, {"points", l.points},
                      {"sum_forward", l.sum_forward}, {"sum_backward", l.sum_backward},
                      {"sum_forward_calls", l.sum_forward_calls}, {"sum_backward_calls", l.sum_backward_calls},
                      {"ring_values", l.ring_values}, {"all_to_all_values", l.all_to_all_values}});
  return layers;
}

/// An integer field of type I: a JSON integer inside I's range, else an error naming it. nlohmann's
/// get<I>() would convert 1e300 (undefined behaviour) or 2^64 - 1 (to -1) out of range.
template <class I>
I integer_field(const nlohmann::json& o, const char* name, std::optional<I> fallback, const std::string& where,
                const std::string& source) {
  if (!o.is_object() || !o.contains(name)) {
    if (fallback) return *fallback;
    CUPIPE_THROW(source, ": ", where, name, " is missing");
  }
  const nlohmann::json& v = o[name];
  constexpr auto lowest = std::numeric_limits<I>::min(), highest = std::numeric_limits<I>::max();
  const bool fits = v.is_number_unsigned() ? v.get<std::uint64_t>() <= std::uint64_t(highest)
                                           : v.is_number_integer() && v.get<std::int64_t>() >= lowest && v.get<std::int64_t>() <= highest;
  // A number is printed; anything else by its type (dump() of a deeply nested array recurses as deep).
  if (!fits)
    CUPIPE_THROW(source, ": ", where, name, " must be an integer in [", lowest, ", ", highest, "], found ",
                 v.is_number() ? v.dump() : std::string(v.type_name()));
  return v.get<I>();
}

}  // namespace detail

inline nlohmann::json to_json(const CostModel& m) {
  nlohmann::json variants = nlohmann::json::array();
  for (const TensorVariant& v : m.tensor_variants) variants.push_back({{"degree", v.degree}, {"layers", detail::layers_json(v.layers)}});
  return {{"profiled_rows", m.profiled_rows}, {"rows_per_sample", m.rows_per_sample}, {"value_bytes", m.value_bytes},
          {"compute_bytes", m.gradient_bytes()}, {"optimizer_slots", m.optimizer_slots}, {"link_latency", m.link_latency},
          {"link_bytes_per_second", m.link_bytes_per_second}, {"allreduce_bytes_per_second", m.allreduce_bytes_per_second},
          {"offload_bytes_per_second", m.offload_bytes_per_second},
          {"update_seconds_per_param", m.update_seconds_per_param}, {"step_overhead_seconds", m.step_overhead_seconds},
          {"action_overhead_seconds", m.action_overhead_seconds}, {"wake_seconds", m.wake_seconds}, {"contention", m.contention},
          {"tied", m.tied}, {"tensor_sum_latency", m.tensor_sum_latency},
          {"calibration_spread", m.calibration_spread}, {"calibration_rounds", m.calibration_rounds},
          {"tensor_sum_bytes_per_second", m.tensor_sum_bytes_per_second}, {"expert_ranks", m.expert_ranks},
          {"all_to_all_latency", m.all_to_all_latency}, {"all_to_all_bytes_per_second", m.all_to_all_bytes_per_second},
          {"layers", detail::layers_json(m.layers)}, {"tensor_variants", variants}};
}

/// Reads a cost model; a missing or mistyped field, or an integer out of its type's range, is an
/// error naming `source` and the field.
inline CostModel cost_model_from_json(const nlohmann::json& j, const std::string& source) {
  const auto field = [&](const nlohmann::json& o, const char* name, const std::string& where) -> const nlohmann::json& {
    if (!o.is_object() || !o.contains(name)) CUPIPE_THROW(source, ": ", where, name, " is missing");
    if (!o[name].is_number() && !o[name].is_string()) CUPIPE_THROW(source, ": ", where, name, " must be a number");
    return o[name];
  };
  CostModel m;
  try {
    m.profiled_rows = detail::integer_field<index_t>(j, "profiled_rows", std::nullopt, "", source);
    m.rows_per_sample = detail::integer_field<index_t>(j, "rows_per_sample", 1, "", source);
    m.value_bytes = detail::integer_field<int>(j, "value_bytes", 4, "", source);
    m.compute_bytes = detail::integer_field<int>(j, "compute_bytes", 0, "", source);
    m.optimizer_slots = detail::integer_field<int>(j, "optimizer_slots", 2, "", source);
    m.link_latency = j.value("link_latency", 0.0);
    m.link_bytes_per_second = j.value("link_bytes_per_second", 0.0);
    m.allreduce_bytes_per_second = j.value("allreduce_bytes_per_second", 0.0);
    m.offload_bytes_per_second = j.value("offload_bytes_per_second", 0.0);
    m.update_seconds_per_param = j.value("update_seconds_per_param", 0.0);
    m.step_overhead_seconds = j.value("step_overhead_seconds", 0.0);
    m.action_overhead_seconds = j.value("action_overhead_seconds", 0.0);
    m.wake_seconds = j.value("wake_seconds", 0.0);
    m.contention = j.value("contention", std::vector<double>{});
    m.tied = j.value("tied", false);
    m.calibration_spread = j.value("calibration_spread", 0.0);
    m.calibration_rounds = detail::integer_field<int>(j, "calibration_rounds", 0, "", source);
    m.tensor_sum_latency = j.value("tensor_sum_latency", 0.0);
    m.tensor_sum_bytes_per_second = j.value("tensor_sum_bytes_per_second", 0.0);
    m.expert_ranks = detail::integer_field<int>(j, "expert_ranks", 1, "", source);
    if (m.expert_ranks < 1) CUPIPE_THROW(source, ": expert_ranks must be at least 1, found ", m.expert_ranks);
    m.all_to_all_latency = j.value("all_to_all_latency", 0.0);
    m.all_to_all_bytes_per_second = j.value("all_to_all_bytes_per_second", 0.0);
    const auto read_layers = [&](const nlohmann::json& o, const std::string& prefix) {
      if (!o.contains("layers") || !o["layers"].is_array()) CUPIPE_THROW(source, ": ", prefix, "layers must be an array");
      std::vector<LayerCost> out;
      for (std::size_t i = 0; i < o["layers"].size(); ++i) {
        const nlohmann::json& l = o["layers"][i];
        const std::string where = prefix + "layers[" + std::to_string(i) + "].";
        LayerCost c{l.value("name", "layer" + std::to_string(i)), field(l, "forward", where).get<double>(),
                    field(l, "backward_input", where).get<double>(), field(l, "backward_weight", where).get<double>(),
                    field(l, "params", where).get<double>(), field(l, "in", where).get<double>(),
                    field(l, "out", where).get<double>(), l.value("saved", 0.0), l.value("forward_fixed", 0.0),
                    l.value("backward_input_fixed", 0.0), l.value("backward_weight_fixed", 0.0),
                    l.value("points", std::vector<std::array<double, 4>>{})};
        c.sum_forward = l.value("sum_forward", 0.0);
        c.ring_values = l.value("ring_values", 0.0);
        c.all_to_all_values = l.value("all_to_all_values", 0.0);
        c.sum_backward = l.value("sum_backward", 0.0);
        c.sum_forward_calls = l.value("sum_forward_calls", 0.0);
        c.sum_backward_calls = l.value("sum_backward_calls", 0.0);
        out.push_back(std::move(c));
      }
      return out;
    };
    m.layers = read_layers(j, "");
    if (j.contains("tensor_variants")) {
      if (!j["tensor_variants"].is_array()) CUPIPE_THROW(source, ": tensor_variants must be an array");
      for (std::size_t i = 0; i < j["tensor_variants"].size(); ++i) {
        const nlohmann::json& v = j["tensor_variants"][i];
        const std::string where = "tensor_variants[" + std::to_string(i) + "].";
        m.tensor_variants.push_back({detail::integer_field<int>(v, "degree", std::nullopt, where, source), read_layers(v, where)});
      }
    }
  } catch (const nlohmann::json::exception& e) {
    CUPIPE_THROW(source, ": ", e.what());
  }
  return m;
}

}  // namespace cupipe::planner
