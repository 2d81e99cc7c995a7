// SPDX-License-Identifier: Apache-2.0
#pragma once

#define CUPIPE_VERSION_MAJOR 0
#define CUPIPE_VERSION_MINOR 1
#define CUPIPE_VERSION_PATCH 0

namespace cupipe {
inline constexpr const char* version_string = "0.1.0";
}
