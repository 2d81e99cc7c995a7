// SPDX-License-Identifier: Apache-2.0
// NVTX ranges around ops, so Nsight Systems shows which cupipe op each kernel belongs to. Without a
// profiler attached, a push/pop pair costs a few nanoseconds.
#pragma once

#include <nvtx3/nvToolsExt.h>

namespace cupipe::backend::cuda {

class NvtxRange {
 public:
  explicit NvtxRange(const char* name) noexcept { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace cupipe::backend::cuda
