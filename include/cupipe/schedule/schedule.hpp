// SPDX-License-Identifier: Apache-2.0
// Everything in schedule/: actions, placements, policies and their registry, verify, simulate, weight
// versions, timelines.
#pragma once

#include "cupipe/schedule/action.hpp"
#include "cupipe/schedule/placement.hpp"
#include "cupipe/schedule/policies/user_plan.hpp"
#include "cupipe/schedule/policy.hpp"
#include "cupipe/schedule/registry.hpp"
#include "cupipe/schedule/simulate.hpp"
#include "cupipe/schedule/steps.hpp"
#include "cupipe/schedule/timeline.hpp"
#include "cupipe/schedule/verify.hpp"
#include "cupipe/schedule/weight_readers.hpp"
#include "cupipe/schedule/weights.hpp"
