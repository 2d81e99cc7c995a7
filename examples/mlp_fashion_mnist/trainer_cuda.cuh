// SPDX-License-Identifier: Apache-2.0
// What the CUDA units share: the bf16 backend's name and the CUDA training loops (trainer.hpp's
// train_family) each unit leaves to another: the flush family is trainer_cuda.cu's, the two-chunk and
// asynchronous families trainer_cuda_other.cu's, in fp32 and bf16.
#pragma once

#include "cupipe/cupipe.cuh"
#include "trainer.hpp"

namespace fmnist {

/// backend::Cuda<bfloat16, float>: --precision bf16 --backend cuda.
using CudaBf16 = backend::Cuda<cupipe::bfloat16, float>;  // in full: OpenBLAS declares a ::bfloat16 too

#define CUPIPE_MLP_TRAIN_CUDA(F, B) \
  extern template int train_family<examples::ScheduleFamily::F, B>(const Flags&, io::Dataset&, const io::Dataset&, const Launch&);
CUPIPE_MLP_TRAIN_CUDA(flush, backend::Cuda<T>)
CUPIPE_MLP_TRAIN_CUDA(flush, CudaBf16)
CUPIPE_MLP_TRAIN_CUDA(chunked, backend::Cuda<T>)
CUPIPE_MLP_TRAIN_CUDA(chunked, CudaBf16)
CUPIPE_MLP_TRAIN_CUDA(asynchronous, backend::Cuda<T>)
CUPIPE_MLP_TRAIN_CUDA(asynchronous, CudaBf16)
#undef CUPIPE_MLP_TRAIN_CUDA

}  // namespace fmnist
