// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: any bytes as the planner's cost-model JSON, read as cupipe_plan --costs reads
// it (JSON text, then planner::cost_model_from_json). Reading must succeed or throw cupipe::error (a
// text that is not JSON is refused before the cost model); a model read must write back
// (planner::to_json) to JSON that reads back to the same model.
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "cupipe/planner/cost_json.hpp"
#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace cupipe;
  nlohmann::json text;
  try {
    text = nlohmann::json::parse(data, data + size);
  } catch (const nlohmann::json::exception&) {  // not JSON (cupipe_plan names the file and refuses it)
    return 0;
  }
  std::optional<planner::CostModel> model;
  fuzz::refuse_or_accept([&] { model = planner::cost_model_from_json(text, "input.json"); });
  if (!model) return 0;
  // Outside the catch: a model read that does not write back is a finding.
  const std::string written = planner::to_json(*model).dump();
  if (planner::to_json(planner::cost_model_from_json(nlohmann::json::parse(written), "written")).dump() != written)
    __builtin_trap();
  return 0;
}
