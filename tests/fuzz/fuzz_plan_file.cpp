// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: any bytes as a schedule plan file, read both as CSV (plan.csv) and as JSON
// (plan.json), as the explorer's --plan reads one. Reading must succeed or throw cupipe::error; a
// plan read must write back, in either format, to text that reads back to the same plan.
#include <optional>
#include <string>

#include "cupipe/io/plan_file.hpp"
#include "fuzz_support.hpp"

namespace {

void check_round_trip(const cupipe::schedule::Plan& plan) {
  using namespace cupipe;
  const std::string csv = io::plan_to_csv(plan);
  if (io::plan_to_csv(io::plan_from_csv(csv)) != csv) __builtin_trap();
  if (io::plan_to_csv(io::plan_from_json(io::plan_to_json(plan))) != csv) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace cupipe;
  for (const char* name : {"plan.csv", "plan.json"}) {
    const auto path = fuzz::scratch() / name;
    fuzz::write(path, data, size);
    std::optional<schedule::Plan> plan;
    fuzz::refuse_or_accept([&] { plan = io::load_plan(path); });
    if (plan) check_round_trip(*plan);  // outside the catch: a plan read that does not write back is a finding
  }
  return 0;
}
