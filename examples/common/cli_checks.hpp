// SPDX-License-Identifier: Apache-2.0
// Command-line checks the example trainers share: "--epochs: must be a positive number, got '0'"
// instead of CLI::PositiveNumber's "Value 0 not in range 0.000000 to 1797693..." (a 309-digit number).
#pragma once

#include <CLI/CLI.hpp>

#include <exception>
#include <string>

#include "cupipe/core/wire.hpp"

namespace cupipe::examples {

inline CLI::Validator number_check(bool zero_allowed) {
  return CLI::Validator(
      [zero_allowed](std::string& text) -> std::string {
        try {
          std::size_t used = 0;
          const double value = std::stod(text, &used);
          if (used == text.size() && (value > 0 || (zero_allowed && value == 0))) return {};
        } catch (const std::exception&) {
        }
        return std::string(zero_allowed ? "must be 0 or a positive number" : "must be a positive number") + ", got '" +
               text + "'";
      },
      zero_allowed ? "NONNEGATIVE" : "POSITIVE");
}
inline const CLI::Validator positive = number_check(false);
inline const CLI::Validator non_negative = number_check(true);

/// --check-equivalence N, the same in both trainers (PipelineOptions::check_equivalence).
inline void add_check_equivalence(CLI::App& app, int& steps) {
  app.add_option("--check-equivalence", steps,
                 "run the first N steps also through the same model unpipelined (one worker) and stop with the "
                 "first tensor whose loss, gradient or updated weights differ beyond the precision's bound "
                 "(flush schedules, one process; docs/trainer.md); 0: off")
      ->capture_default_str()
      ->check(non_negative);
}

/// --hand-over, the same in both trainers (PipelineOptions::hand_over): "full", "bf16" or "e4m3" for
/// every link, or a comma-separated list with one per link between neighbouring virtual stages.
inline void add_hand_over(CLI::App& app, std::string& text) {
  app.add_option("--hand-over", text,
                 "the precision of stage-to-stage hand-overs, activations forward and gradients back: full, bf16 "
                 "or e4m3 (FP8 with a per-tensor scale) for every link, or one per link, comma-separated "
                 "(docs/trainer.md)")
      ->capture_default_str()
      ->check([](const std::string& value) -> std::string {
        try {
          parse_wires(value);
          return {};
        } catch (const std::exception& e) {
          return e.what();
        }
      });
}

}  // namespace cupipe::examples
