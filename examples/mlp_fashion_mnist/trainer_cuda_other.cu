// SPDX-License-Identifier: Apache-2.0
// The CUDA training loops (trainer.hpp's train_family) of the two-chunk schedules (interleaved, BFS,
// ZBV, V-Half, V-Min, DualPipeV) and the asynchronous ones (PipeDream, 2BW), in fp32 and bf16, in
// their own nvcc unit beside trainer_cuda.cu's flush family. Only builds that compile every schedule
// have it (examples/CMakeLists.txt).
#include "trainer_cuda.cuh"

namespace fmnist {

template int train_family<examples::ScheduleFamily::chunked, backend::Cuda<T>>(const Flags&, io::Dataset&,
                                                                               const io::Dataset&, const Launch&);
template int train_family<examples::ScheduleFamily::asynchronous, backend::Cuda<T>>(const Flags&, io::Dataset&,
                                                                                    const io::Dataset&, const Launch&);
template int train_family<examples::ScheduleFamily::chunked, CudaBf16>(const Flags&, io::Dataset&, const io::Dataset&,
                                                                       const Launch&);
template int train_family<examples::ScheduleFamily::asynchronous, CudaBf16>(const Flags&, io::Dataset&,
                                                                            const io::Dataset&, const Launch&);

}  // namespace fmnist
