// SPDX-License-Identifier: Apache-2.0
// A mixture of experts' token movement on backend::Cuda: moe_permute, moe_unpermute and their
// backwards, with the host ops' names, signatures and checks (backend/host/ops_moe.hpp, the
// reference) and the kernels of backend/cuda/kernels/moe.cuh. A slot outside [-1, S) is reported by
// the kernel; with be.check_inputs the op waits for the report and throws the host's message.
//
// Compiled, not yet run on a GPU (docs/gpu_notes.md): tests/cuda/test_cuda_moe.cu checks them
// against the host ops when a GPU is lent.
#pragma once

#include <cstdint>
#include <string_view>

#include "cupipe/backend/cuda/cuda.cuh"
#include "cupipe/backend/cuda/kernels/moe.cuh"
#include "cupipe/backend/cuda/ops.cuh"
#include "cupipe/backend/op_checks.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe::backend::cuda::detail {

/// Throws the host's message for a slot a kernel reported (with be.check_inputs, which waits).
template <class T, class C>
void check_reported_slots(backend::Cuda<T, C>& be, std::string_view op, index_t rows) {
  check_reported(be, op, backend::cuda::moe_slot_out_of_range,
                 [&](long long value, index_t at) { ops::checks::moe_slot_out_of_range(op, value, at, rows); });
}

}  // namespace cupipe::backend::cuda::detail

namespace cupipe::ops {

template <class T, class C>
void moe_permute(backend::Cuda<T, C>& be, DeviceConstView<T> x, DeviceConstView<std::int32_t> slots, DeviceView<T> xs) {
  checks::moe_permute(x, slots, xs);
  const backend::cuda::detail::OpScope scope(be, "cupipe::moe_permute");
  backend::cuda::kernels::moe_permute(be.context(), backend::cuda::detail::device_ptr(x.data()), slots.data(),
                                      backend::cuda::detail::device_ptr(xs.data()), x.rows(), slots.cols(), x.cols(),
                                      xs.rows());
  backend::cuda::detail::check_reported_slots(be, "moe_permute", xs.rows());
}

template <class T, class C>
void moe_unpermute(backend::Cuda<T, C>& be, DeviceConstView<T> o, DeviceConstView<std::int32_t> slots,
                   DeviceConstView<T> gates, DeviceView<T> y) {
  checks::moe_unpermute(o, slots, gates, y);
  const backend::cuda::detail::OpScope scope(be, "cupipe::moe_unpermute");
  backend::cuda::kernels::moe_unpermute(be.context(), backend::cuda::detail::device_ptr(o.data()), slots.data(),
                                        backend::cuda::detail::device_ptr(gates.data()),
                                        backend::cuda::detail::device_ptr(y.data()), slots.rows(), slots.cols(), o.cols(),
                                        o.rows());
  backend::cuda::detail::check_reported_slots(be, "moe_unpermute", o.rows());
}

template <class T, class C>
void moe_unpermute_backward(backend::Cuda<T, C>& be, DeviceConstView<T> dy, DeviceConstView<T> o,
                            DeviceConstView<std::int32_t> slots, DeviceConstView<T> gates, DeviceView<T> d_o,
                            DeviceView<T> dgates) {
  checks::moe_unpermute_backward(dy, o, slots, gates, d_o, dgates);
  const backend::cuda::detail::OpScope scope(be, "cupipe::moe_unpermute_backward");
  backend::cuda::kernels::moe_unpermute_backward(
      be.context(), backend::cuda::detail::device_ptr(dy.data()), backend::cuda::detail::device_ptr(o.data()), slots.data(),
      backend::cuda::detail::device_ptr(gates.data()), backend::cuda::detail::device_ptr(d_o.data()),
      backend::cuda::detail::device_ptr(dgates.data()), slots.rows(), slots.cols(), o.cols(), o.rows());
  backend::cuda::detail::check_reported_slots(be, "moe_unpermute_backward", o.rows());
}

template <class T, class C>
void moe_permute_backward(backend::Cuda<T, C>& be, DeviceConstView<T> dxs, DeviceConstView<std::int32_t> slots,
                          DeviceView<T> dx) {
  checks::moe_permute_backward(dxs, slots, dx);
  const backend::cuda::detail::OpScope scope(be, "cupipe::moe_permute_backward");
  backend::cuda::kernels::moe_permute_backward(be.context(), backend::cuda::detail::device_ptr(dxs.data()), slots.data(),
                                               backend::cuda::detail::device_ptr(dx.data()), slots.rows(), slots.cols(),
                                               dxs.cols(), dxs.rows());
  backend::cuda::detail::check_reported_slots(be, "moe_permute_backward", dxs.rows());
}

}  // namespace cupipe::ops
