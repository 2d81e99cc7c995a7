// SPDX-License-Identifier: Apache-2.0
// gpt_train's CUDA training loops (trainer_cuda.cuh's train_cuda_family) of the two-chunk schedules
// (interleaved, BFS, ZBV, V-Half, V-Min, DualPipeV) and the asynchronous ones (PipeDream, 2BW), in
// fp32 and bf16, for both presets, in their own nvcc unit beside trainer_cuda.cu's flush family. Only
// builds that compile every schedule have it (examples/CMakeLists.txt).
#include "trainer_cuda.cuh"

namespace gpt_trainer {

template int train_cuda_family<examples::ScheduleFamily::chunked>(const Flags&, const io::TokenCorpus&,
                                                                  const io::TokenSplit&, const Launch&,
                                                                  const DeviceRate&, backend::cuda::MathMode);
template int train_cuda_family<examples::ScheduleFamily::asynchronous>(const Flags&, const io::TokenCorpus&,
                                                                       const io::TokenSplit&, const Launch&,
                                                                       const DeviceRate&, backend::cuda::MathMode);

}  // namespace gpt_trainer
