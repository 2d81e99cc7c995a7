// SPDX-License-Identifier: Apache-2.0
// CUDA ops: every op of backend/host/ops.hpp, with the same name and signature, on backend::Cuda<T>
// (GEMM lives in gemm.cuh). The conventions are the host's: row-major 2-D views, *_backward_weight
// and bias_backward accumulate, everything else overwrites, and shapes are validated before any
// launch. Each op is an NVTX range and enqueues on the context's stream without waiting, except
// the ones that return a value to the host (sum_of_squares) or check device-side input (labels, token
// ids) when be.check_inputs is set. Every op of the host contract first runs the host's checks
// (backend/op_checks.hpp) on every view (inputs too), for its shape and for a null pointer, before it
// launches anything. An op makes its context's device current while it runs and restores the
// thread's previous device when it returns.
//
// transfer (the pipeline's stage-to-stage hand-over) is in transfer.cuh.
//
// Extra entry points beyond the host contract: convert (float <-> bf16), poison (NaN fill, for tests)
// and adamw_update_master (bf16 parameters with fp32 master weights).
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string_view>
#include <type_traits>

#include "cupipe/backend/cuda/check.cuh"
#include "cupipe/backend/cuda/cuda.cuh"
#include "cupipe/backend/cuda/gemm.cuh"
#include "cupipe/backend/cuda/kernels/elementwise.cuh"
#include "cupipe/backend/cuda/kernels/embedding.cuh"
#include "cupipe/backend/cuda/kernels/layernorm.cuh"
#include "cupipe/backend/cuda/kernels/optimizer.cuh"
#include "cupipe/backend/cuda/kernels/reduce.cuh"
#include "cupipe/backend/cuda/kernels/softmax_xent.cuh"
#include "cupipe/backend/cuda/nvtx.cuh"
#include "cupipe/backend/cuda/stream.cuh"
#include "cupipe/backend/cuda/transfer.cuh"
#include "cupipe/backend/op_checks.hpp"
#include "cupipe/backend/op_types.hpp"
#include "cupipe/core/dtype.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/core/wire.hpp"

namespace cupipe::backend::cuda::detail {

using backend::cuda::kernels::device_ptr;

/// Enters an op: names it for profilers and makes the context's device current until the op returns.
class OpScope {
 public:
  template <class T, class C>
  OpScope(backend::Cuda<T, C>& be, const char* name) : range_(name), device_(be.device()) {}

 private:
  backend::cuda::NvtxRange range_;
  backend::cuda::DeviceGuard device_;
};

template <class V>
auto cptr(const V& view) {
  return static_cast<const backend::cuda::kernels::device_t<typename V::value_type>*>(device_ptr(view.data()));
}

}  // namespace cupipe::backend::cuda::detail
namespace cupipe::ops {

// ---------------------------------------------------------------------------------------------
// Storage and compute types. On Cuda<float> and Cuda<double> both are T. On Cuda<bfloat16, float>
// activations are bf16 (the kernels read bf16, compute in float and round each store to nearest
// even) while the ops that write gradients (bias_backward, layernorm_backward_weight,
// embedding_backward, gemm into a float c), statistics (LayerNorm's mean and rstd, attention's lse)
// and the loss take float views, as on backend::Host<bfloat16, float>. The optimizer ops, copy, fill,
// axpy and sum_of_squares take views of either type.

}  // namespace cupipe::ops
namespace cupipe::backend::cuda::detail {

/// The element types ops on Cuda<T, C> accept where either precision is meant.
template <class V, class T, class C>
concept either_precision = std::is_same_v<std::remove_const_t<V>, T> || std::is_same_v<std::remove_const_t<V>, C>;

/// A scalar argument in the arithmetic of the element type V (float for bf16).
template <class V, class S>
backend::cuda::kernels::acc_t<backend::cuda::kernels::device_t<V>> acc(S value) {
  if constexpr (std::is_same_v<std::remove_cvref_t<S>, bfloat16>) return backend::cuda::kernels::acc_t<backend::cuda::kernels::device_t<V>>(float(value));
  else return backend::cuda::kernels::acc_t<backend::cuda::kernels::device_t<V>>(value);
}

template <class T>
using dev_t = backend::cuda::kernels::device_t<T>;

/// `value` as V's device type (bf16: rounded to nearest even on the host).
template <class V, class A>
dev_t<V> device_value(A value) {
  if constexpr (std::is_same_v<V, bfloat16>) {
    __nv_bfloat16_raw raw;
    raw.x = bfloat16(float(value)).bits;
    return raw;
  } else {
    return V(value);
  }
}

}  // namespace cupipe::backend::cuda::detail
namespace cupipe::ops {

// ---------------------------------------------------------------------------------------------
// Elementwise and broadcast ops.

/// y (rows, n) += bias (n) on every row.
template <class T, class C>
void bias_add(backend::Cuda<T, C>& be, DeviceView<T> y, DeviceConstView<T> bias) {
  checks::bias_add(y, bias);
  const backend::cuda::detail::OpScope scope(be, "cupipe::bias_add");
  backend::cuda::kernels::bias_add(be.context(), backend::cuda::detail::device_ptr(y.data()), backend::cuda::detail::device_ptr(bias.data()), y.rows(), y.cols());
}

/// dbias (n) += column sums of dy (rows, n), accumulated in the compute type.
template <class T, class C>
void bias_backward(backend::Cuda<T, C>& be, DeviceConstView<T> dy, DeviceView<C> dbias) {
  checks::bias_backward(dy, dbias);
  const backend::cuda::detail::OpScope scope(be, "cupipe::bias_backward");
  using DT = backend::cuda::detail::dev_t<T>;
  backend::cuda::kernels::column_sums<1, C>(be.context(), dy.rows(), dy.cols(), backend::cuda::kernels::ColumnValue<DT>{backend::cuda::detail::device_ptr(dy.data()), dy.cols()},
                                   dbias.data());
}

template <class T, class C>
void relu_forward(backend::Cuda<T, C>& be, DeviceConstView<T> x, DeviceView<T> y) {
  checks::relu_forward(x, y);
  const backend::cuda::detail::OpScope scope(be, "cupipe::relu_forward");
  backend::cuda::kernels::transform(be.context(), x.numel(), backend::cuda::kernels::ReluForwardOp<backend::cuda::detail::dev_t<T>>{}, backend::cuda::detail::device_ptr(x.data()),
                           backend::cuda::detail::device_ptr(y.data()));
}

/// dx = dy where x > 0, else 0 (x is the forward input).
template <class T, class C>
void relu_backward(backend::Cuda<T, C>& be, DeviceConstView<T> x, DeviceConstView<T> dy, DeviceView<T> dx) {
  checks::relu_backward(x, dy, dx);
  const backend::cuda::detail::OpScope scope(be, "cupipe::relu_backward");
  backend::cuda::kernels::transform(be.context(), x.numel(), backend::cuda::kernels::ReluBackwardOp<backend::cuda::detail::dev_t<T>>{}, backend::cuda::detail::device_ptr(x.data()),
                           backend::cuda::detail::device_ptr(dy.data()), backend::cuda::detail::device_ptr(dx.data()));
}

/// GELU, tanh form: y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <class T, class C>
void gelu_forward(backend::Cuda<T, C>& be, DeviceConstView<T> x, DeviceView<T> y) {
  checks::gelu_forward(x, y);
  const backend::cuda::detail::OpScope scope(be, "cupipe::gelu_forward");
  backend::cuda::kernels::transform(be.context(), x.numel(), backend::cuda::kernels::GeluForwardOp<backend::cuda::detail::dev_t<T>>{}, backend::cuda::detail::device_ptr(x.data()),
                           backend::cuda::detail::device_ptr(y.data()));
}

template <class T, class C>
void gelu_backward(backend::Cuda<T, C>& be, DeviceConstView<T> x, DeviceConstView<T> dy, DeviceView<T> dx) {
  checks::gelu_backward(x, dy, dx);
  const backend::cuda::detail::OpScope scope(be, "cupipe::gelu_backward");
  backend::cuda::kernels::transform(be.context(), x.numel(), backend::cuda::kernels::GeluBackwardOp<backend::cuda::detail::dev_t<T>>{}, backend::cuda::detail::device_ptr(x.data()),
                           backend::cuda::detail::device_ptr(dy.data()), backend::cuda::detail::device_ptr(dx.data()));
}

/// y = a + b (the residual connection); y may alias a or b.
template <class T, class C>
void residual_add(backend::Cuda<T, C>& be, DeviceConstView<T> a, DeviceConstView<T> b, DeviceView<T> y) {
  checks::residual_add(a, b, y);
  const backend::cuda::detail::OpScope scope(be, "cupipe::residual_add");
  backend::cuda::kernels::transform(be.context(), a.numel(), backend::cuda::kernels::AddOp<backend::cuda::detail::dev_t<T>>{}, backend::cuda::detail::device_ptr(a.data()),
                           backend::cuda::detail::device_ptr(b.data()), backend::cuda::detail::device_ptr(y.data()));
}

/// y += alpha * x, in y's arithmetic. x and y are each of the storage or the compute type (a bf16
/// gradient may be added into a float one, not the other way round).
template <class T, class C, class X, class Y, class S>
  requires(backend::cuda::detail::either_precision<X, T, C> && backend::cuda::detail::either_precision<Y, T, C> && sizeof(X) <= sizeof(Y))
void axpy(backend::Cuda<T, C>& be, S alpha, TensorView<X, DeviceSpace> x_view, DeviceView<Y> y) {
  const DeviceConstView<std::remove_const_t<X>> x = x_view;
  checks::axpy(x, y);
  const backend::cuda::detail::OpScope scope(be, "cupipe::axpy");
  using DX = backend::cuda::detail::dev_t<std::remove_const_t<X>>;
  using DY = backend::cuda::detail::dev_t<Y>;
  backend::cuda::kernels::transform(be.context(), x.numel(), backend::cuda::kernels::AxpyOp<DX, DY>{backend::cuda::detail::acc<Y>(alpha)}, backend::cuda::detail::device_ptr(x.data()),
                           backend::cuda::detail::device_ptr(y.data()));
}

/// y = x as a hand-over of precision `wire` delivers it (the host op, backend/host/ops.hpp, is the
/// reference): bf16 rounds each value (a copy where the storage is bf16); e4m3 scales by 448 / max|x|
/// (one reduction into the context's scratch, read by the next kernel: no wait on the host), rounds
/// to FP8 E4M3 and scales back. y may alias x.
template <class T, class C>
void wire_round_trip(backend::Cuda<T, C>& be, DeviceConstView<T> x, DeviceView<T> y, Wire wire) {
  checks::wire_round_trip(x, y);
  static_assert(!std::is_same_v<T, double>, "wire_round_trip: the CUDA op takes float or bf16 storage");
  using D = backend::cuda::detail::dev_t<T>;
  const bool rounds = wire == Wire::e4m3 || (wire == Wire::bf16 && !std::is_same_v<T, bfloat16>);
  if (!rounds) {
    if (x.numel() > 0 && x.data() != y.data())
      CUPIPE_CHECK_CUDA(cudaMemcpyAsync(y.data(), x.data(), std::size_t(x.numel()) * sizeof(T), cudaMemcpyDeviceToDevice,
                                        be.stream()));
    return;
  }
  const backend::cuda::detail::OpScope scope(be, "cupipe::wire_round_trip");
  const D* in = backend::cuda::detail::device_ptr(x.data());
  D* out = backend::cuda::detail::device_ptr(y.data());
  if (wire == Wire::bf16) {
    backend::cuda::kernels::transform(be.context(), x.numel(), backend::cuda::kernels::RoundBf16Op<D>{}, in, out);
    return;
  }
  auto* state = static_cast<unsigned*>(be.context().scratch(2 * sizeof(unsigned)));
  backend::cuda::kernels::amax(be.context(), in, x.numel(), state);
  backend::cuda::kernels::transform(be.context(), x.numel(), backend::cuda::kernels::E4m3RoundTripOp<D>{state}, in, out);
}

/// `packed` = the message a link of precision `wire` sends for x (core/wire.hpp; the host op,
/// backend/host/wire.hpp, is the reference): bf16 values for float storage; for e4m3, amax's
/// reduction into the context's scratch, the header from it, and each value's code (no host wait).
/// The bytes past the last code (storage rounds up) are zeroed, as on the host.
template <class T, class C>
void wire_pack(backend::Cuda<T, C>& be, DeviceConstView<T> x, DeviceView<T> packed, Wire wire) {
  checks::wire_pack(x, packed, wire);
  static_assert(!std::is_same_v<T, double>, "wire_pack: the CUDA op takes float or bf16 storage");
  using D = backend::cuda::detail::dev_t<T>;
  const backend::cuda::detail::OpScope scope(be, "cupipe::wire_pack");
  const D* in = backend::cuda::detail::device_ptr(x.data());
  auto* bytes = reinterpret_cast<unsigned char*>(packed.data());
  const std::size_t used = wire_bytes(wire, x.numel()), total = std::size_t(packed.numel()) * sizeof(T);
  if (total > used) CUPIPE_CHECK_CUDA(cudaMemsetAsync(bytes + used, 0, total - used, be.stream()));
  if (wire == Wire::bf16) {
    backend::cuda::kernels::transform(be.context(), x.numel(), backend::cuda::kernels::PackBf16Op<D>{}, in,
                                      reinterpret_cast<__nv_bfloat16*>(bytes));
    return;
  }
  auto* state = static_cast<unsigned*>(be.context().scratch(2 * sizeof(unsigned)));
  backend::cuda::kernels::amax(be.context(), in, x.numel(), state);
  backend::cuda::kernels::wire_header(be.context(), state, reinterpret_cast<double*>(bytes));
  backend::cuda::kernels::transform(be.context(), x.numel(), backend::cuda::kernels::E4m3PackOp<D>{state}, in,
                                    bytes + wire_header_bytes);
}

/// y = the values of a packed message (the host op is the reference): wire_round_trip's values for a
/// finite tensor, all NaN for one with a value that is not finite.
template <class T, class C>
void wire_unpack(backend::Cuda<T, C>& be, DeviceConstView<T> packed, DeviceView<T> y, Wire wire) {
  checks::wire_unpack(packed, y, wire);
  static_assert(!std::is_same_v<T, double>, "wire_unpack: the CUDA op takes float or bf16 storage");
  using D = backend::cuda::detail::dev_t<T>;
  const backend::cuda::detail::OpScope scope(be, "cupipe::wire_unpack");
  const auto* bytes = reinterpret_cast<const unsigned char*>(packed.data());
  D* out = backend::cuda::detail::device_ptr(y.data());
  if (wire == Wire::bf16) {
    backend::cuda::kernels::transform(be.context(), y.numel(), backend::cuda::kernels::UnpackBf16Op<D>{},
                                      reinterpret_cast<const __nv_bfloat16*>(bytes), out);
    return;
  }
  backend::cuda::kernels::transform(be.context(), y.numel(),
                                    backend::cuda::kernels::E4m3UnpackOp<D>{reinterpret_cast<const double*>(bytes)},
                                    bytes + wire_header_bytes, out);
}

template <class T, class C, class V>
  requires backend::cuda::detail::either_precision<V, T, C>
void copy(backend::Cuda<T, C>& be, DeviceConstView<V> from, DeviceView<V> to) {
  checks::copy(from, to);
  if (from.numel() == 0 || from.data() == to.data()) return;
  const backend::cuda::detail::OpScope scope(be, "cupipe::copy");
  CUPIPE_CHECK_CUDA(cudaMemcpyAsync(to.data(), from.data(), std::size_t(from.numel()) * sizeof(V),
                                    cudaMemcpyDeviceToDevice, be.stream()));
}

template <class T, class C, class V, class S>
  requires backend::cuda::detail::either_precision<V, T, C>
void fill(backend::Cuda<T, C>& be, DeviceView<V> y, S value) {
  checks::fill(y);
  const backend::cuda::detail::OpScope scope(be, "cupipe::fill");
  using DV = backend::cuda::detail::dev_t<V>;
  const DV v = backend::cuda::detail::device_value<V>(backend::cuda::detail::acc<V>(value));
  backend::cuda::kernels::transform(be.context(), y.numel(), backend::cuda::kernels::FillOp<DV>{v}, backend::cuda::detail::device_ptr(y.data()));
}

/// Fills y with quiet NaN, so a test sees every element an op fails to write. Any float type.
template <class T, class C, class U>
void poison(backend::Cuda<T, C>& be, DeviceView<U> y) {
  static_assert(std::is_floating_point_v<U> || std::is_same_v<U, bfloat16>, "poison: NaN needs a floating-point type");
  check_view(y, y.shape(), "poison", "y");
  const backend::cuda::detail::OpScope scope(be, "cupipe::poison");
  using D = backend::cuda::kernels::device_t<U>;
  D nan;
  if constexpr (std::is_same_v<U, bfloat16>) {
    __nv_bfloat16_raw raw;
    raw.x = bfloat16(std::numeric_limits<float>::quiet_NaN()).bits;
    nan = raw;
  } else {
    nan = std::numeric_limits<U>::quiet_NaN();
  }
  backend::cuda::kernels::transform(be.context(), y.numel(), backend::cuda::kernels::FillOp<D>{nan}, backend::cuda::detail::device_ptr(y.data()));
}

/// Element type conversion (float, double, bfloat16; bf16 rounds to nearest even). `from` may be a
/// const or mutable view (its element type is deduced).
template <class T, class C, class From, class To>
void convert(backend::Cuda<T, C>& be, DeviceView<From> from, DeviceView<To> to) {
  check_view(from, from.shape(), "convert", "source");
  check_view(to, from.shape(), "convert", "destination");
  const backend::cuda::detail::OpScope scope(be, "cupipe::convert");
  using DF = backend::cuda::kernels::device_t<std::remove_const_t<From>>;
  using DT = backend::cuda::kernels::device_t<To>;
  backend::cuda::kernels::transform(be.context(), from.numel(), backend::cuda::kernels::ConvertOp<DF, DT>{}, backend::cuda::detail::cptr(from),
                           backend::cuda::detail::device_ptr(to.data()));
}

// ---------------------------------------------------------------------------------------------
// LayerNorm over the last axis (see host/ops.hpp for the formulas); mean and rstd are saved, in the
// compute type.

template <class T, class C>
void layernorm_forward(backend::Cuda<T, C>& be, DeviceConstView<T> x, DeviceConstView<T> gamma, DeviceConstView<T> beta,
                       DeviceView<T> y, DeviceView<C> mean, DeviceView<C> rstd, double eps) {
  const index_t rows = x.rows(), n = x.cols();
  checks::layernorm_forward(x, gamma, beta, y, mean, rstd);
  const backend::cuda::detail::OpScope scope(be, "cupipe::layernorm_forward");
  backend::cuda::kernels::layernorm_forward(be.context(), backend::cuda::detail::device_ptr(x.data()), backend::cuda::detail::device_ptr(gamma.data()), backend::cuda::detail::device_ptr(beta.data()),
                                   backend::cuda::detail::device_ptr(y.data()), mean.data(), rstd.data(), rows, n, eps);
}

template <class T, class C>
void layernorm_backward_input(backend::Cuda<T, C>& be, DeviceConstView<T> x, DeviceConstView<T> gamma, DeviceConstView<C> mean,
                              DeviceConstView<C> rstd, DeviceConstView<T> dy, DeviceView<T> dx) {
  const index_t rows = x.rows(), n = x.cols();
  checks::layernorm_backward_input(x, gamma, mean, rstd, dy, dx);
  const backend::cuda::detail::OpScope scope(be, "cupipe::layernorm_backward_input");
  backend::cuda::kernels::layernorm_backward_input(be.context(), backend::cuda::detail::device_ptr(x.data()), backend::cuda::detail::device_ptr(gamma.data()), mean.data(), rstd.data(),
                                          backend::cuda::detail::device_ptr(dy.data()), backend::cuda::detail::device_ptr(dx.data()), rows, n);
}

/// dgamma += sum over rows of dy * xhat; dbeta += sum over rows of dy (deterministic).
template <class T, class C>
void layernorm_backward_weight(backend::Cuda<T, C>& be, DeviceConstView<T> x, DeviceConstView<C> mean, DeviceConstView<C> rstd,
                               DeviceConstView<T> dy, DeviceView<C> dgamma, DeviceView<C> dbeta) {
  const index_t rows = x.rows(), n = x.cols();
  checks::layernorm_backward_weight(x, mean, rstd, dy, dgamma, dbeta);
  const backend::cuda::detail::OpScope scope(be, "cupipe::layernorm_backward_weight");
  backend::cuda::kernels::layernorm_backward_weight(be.context(), backend::cuda::detail::device_ptr(x.data()), mean.data(), rstd.data(), backend::cuda::detail::device_ptr(dy.data()),
                                           dgamma.data(), dbeta.data(), rows, n);
}

// ---------------------------------------------------------------------------------------------
// Fused softmax cross-entropy (see host/ops.hpp). Labels live in device memory, so a label out of
// range is found by the kernel and reported through the context's device error record.

}  // namespace cupipe::ops
namespace cupipe::backend::cuda::detail {

/// With be.check_inputs (it waits): throws for what a kernel reported, `report(value, row)` for the
/// code `expected` (which throws the host's message for that bad input), any other code by number.
template <class T, class C, class Report>
void check_reported(backend::Cuda<T, C>& be, std::string_view op, std::int32_t expected, Report&& report) {
  if (!be.check_inputs) return;
  const backend::cuda::DeviceError found = be.context().take_device_error();
  if (found.code == expected) report(found.value, found.row);
  if (found.code != backend::cuda::no_error)
    CUPIPE_THROW(op, ": an earlier kernel on this context reported bad input (code ", found.code, ", row ", found.row,
                 ", value ", found.value, ")");
}

template <class T, class C>
void check_reported_labels(backend::Cuda<T, C>& be, std::string_view op, const Shape& logits, index_t classes = -1) {
  check_reported(be, op, backend::cuda::label_out_of_range, [&](long long value, index_t row) {
    ops::checks::label_out_of_range(op, value, row, logits, classes < 0 ? logits.cols() : classes);
  });
}

template <class T, class C>
void check_reported_ids(backend::Cuda<T, C>& be, std::string_view op, index_t vocab) {
  check_reported(be, op, backend::cuda::token_id_out_of_range,
                 [&](long long value, index_t row) { ops::checks::token_id_out_of_range(op, value, row, vocab); });
}

}  // namespace cupipe::backend::cuda::detail
namespace cupipe::ops {

/// loss (1,) = sum over rows of (logsumexp(z_r) - z_r[label_r]) / normalizer, in device memory, in
/// the compute type.
template <class T, class C>
void softmax_cross_entropy_forward(backend::Cuda<T, C>& be, DeviceConstView<T> logits, DeviceConstView<std::int32_t> labels,
                                   DeviceView<C> loss, index_t normalizer) {
  checks::softmax_cross_entropy_forward(logits, labels, loss, normalizer);
  const backend::cuda::detail::OpScope scope(be, "cupipe::softmax_cross_entropy_forward");
  backend::cuda::kernels::softmax_cross_entropy_forward(be.context(), backend::cuda::detail::device_ptr(logits.data()), labels.data(), loss.data(), logits.rows(),
                                               logits.cols(), normalizer);
  backend::cuda::detail::check_reported_labels(be, "softmax_cross_entropy_forward", logits.shape());
}

/// dlogits = (softmax(z) - onehot(label)) * dloss / normalizer.
template <class T, class C, class S = C>
void softmax_cross_entropy_backward(backend::Cuda<T, C>& be, DeviceConstView<T> logits, DeviceConstView<std::int32_t> labels,
                                    DeviceView<T> dlogits, index_t normalizer, S dloss = S(1)) {
  checks::softmax_cross_entropy_backward(logits, labels, dlogits, normalizer);
  const backend::cuda::detail::OpScope scope(be, "cupipe::softmax_cross_entropy_backward");
  using A = backend::cuda::kernels::acc_t<backend::cuda::detail::dev_t<T>>;
  // As the host op: dloss / normalizer in the arithmetic type (float for bf16 storage).
  const A scale = backend::cuda::detail::acc<T>(dloss) / A(normalizer);
  backend::cuda::kernels::softmax_cross_entropy_backward(be.context(), backend::cuda::detail::device_ptr(logits.data()), labels.data(), backend::cuda::detail::device_ptr(dlogits.data()),
                                                logits.rows(), logits.cols(), scale);
  backend::cuda::detail::check_reported_labels(be, "softmax_cross_entropy_backward", logits.shape());
}

/// Vocabulary-parallel cross-entropy's statistics (host ops.hpp): stats (rows, 3) in the compute
/// type (float for bf16 logits, as on the host).
template <class T, class C>
void softmax_cross_entropy_part_stats(backend::Cuda<T, C>& be, DeviceConstView<T> logits, DeviceConstView<std::int32_t> labels,
                                      DeviceView<C> stats, VocabPart part) {
  checks::softmax_cross_entropy_part_stats(logits, labels, stats, part);
  const backend::cuda::detail::OpScope scope(be, "cupipe::softmax_cross_entropy_part_stats");
  backend::cuda::kernels::softmax_cross_entropy_part_stats(be.context(), backend::cuda::detail::device_ptr(logits.data()), labels.data(),
                                                  stats.data(), logits.rows(), logits.cols(), part.first, part.whole);
  backend::cuda::detail::check_reported_labels(be, "softmax_cross_entropy_part_stats", logits.shape(), part.whole);
}

/// dlogits = (exp(z - lse) - onehot(label)) * dloss / normalizer over a vocabulary part; lse (rows,)
/// in the compute type.
template <class T, class C, class S = C>
void softmax_cross_entropy_part_backward(backend::Cuda<T, C>& be, DeviceConstView<T> logits,
                                         DeviceConstView<std::int32_t> labels, DeviceConstView<C> lse, DeviceView<T> dlogits,
                                         index_t normalizer, VocabPart part, S dloss = S(1)) {
  checks::softmax_cross_entropy_part_backward(logits, labels, lse, dlogits, normalizer, part);
  const backend::cuda::detail::OpScope scope(be, "cupipe::softmax_cross_entropy_part_backward");
  using A = backend::cuda::kernels::acc_t<backend::cuda::detail::dev_t<T>>;
  const A scale = backend::cuda::detail::acc<T>(dloss) / A(normalizer);
  backend::cuda::kernels::softmax_cross_entropy_backward(be.context(), backend::cuda::detail::device_ptr(logits.data()), labels.data(),
                                                backend::cuda::detail::device_ptr(dlogits.data()), logits.rows(), logits.cols(), scale,
                                                lse.data(), part.first, part.whole);
  backend::cuda::detail::check_reported_labels(be, "softmax_cross_entropy_part_backward", logits.shape(), part.whole);
}

// ---------------------------------------------------------------------------------------------
// Embedding: y (rows, dim) = table[ids]; the backward is deterministic (kernels/embedding.cuh). With
// a VocabPart the table is rows [first, first + rows) of the whole vocabulary's (host ops.hpp).

template <class T, class C>
void embedding_forward(backend::Cuda<T, C>& be, DeviceConstView<std::int32_t> ids, DeviceConstView<T> table, DeviceView<T> y,
                       VocabPart part) {
  checks::embedding_forward(ids, table, y, part);
  const backend::cuda::detail::OpScope scope(be, "cupipe::embedding_forward");
  backend::cuda::kernels::embedding_forward(be.context(), ids.data(), backend::cuda::detail::device_ptr(table.data()), backend::cuda::detail::device_ptr(y.data()), ids.numel(),
                                   table.cols(), part.first, table.rows(), part.whole);
  backend::cuda::detail::check_reported_ids(be, "embedding_forward", part.whole);
}

template <class T, class C>
void embedding_forward(backend::Cuda<T, C>& be, DeviceConstView<std::int32_t> ids, DeviceConstView<T> table, DeviceView<T> y) {
  embedding_forward(be, ids, table, y, VocabPart{0, table.rows()});
}

/// dtable[id] += dy rows, accumulated in the compute type.
template <class T, class C>
void embedding_backward(backend::Cuda<T, C>& be, DeviceConstView<std::int32_t> ids, DeviceConstView<T> dy, DeviceView<C> dtable,
                        VocabPart part) {
  checks::embedding_backward(ids, dy, dtable, part);
  const backend::cuda::detail::OpScope scope(be, "cupipe::embedding_backward");
  backend::cuda::kernels::embedding_backward(be.context(), ids.data(), backend::cuda::detail::device_ptr(dy.data()), dtable.data(), ids.numel(), dtable.cols(),
                                    part.first, dtable.rows(), part.whole);
  backend::cuda::detail::check_reported_ids(be, "embedding_backward", part.whole);
}

template <class T, class C>
void embedding_backward(backend::Cuda<T, C>& be, DeviceConstView<std::int32_t> ids, DeviceConstView<T> dy, DeviceView<C> dtable) {
  embedding_backward(be, ids, dy, dtable, VocabPart{0, dtable.rows()});
}

// ---------------------------------------------------------------------------------------------
// Optimizer updates and reductions.

/// Sum of squares of all elements (storage or compute type), accumulated in double by a fixed
/// two-phase reduction. Waits for the result.
template <class T, class C, class V>
  requires backend::cuda::detail::either_precision<V, T, C>
double sum_of_squares(backend::Cuda<T, C>& be, TensorView<V, DeviceSpace> x_view) {
  const DeviceConstView<std::remove_const_t<V>> x = x_view;
  checks::sum_of_squares(x);
  if (x.numel() == 0) return 0.0;
  const backend::cuda::detail::OpScope scope(be, "cupipe::sum_of_squares");
  // The partials first, the result after them.
  auto* partial = static_cast<double*>(
      be.context().scratch(std::size_t(1 + backend::cuda::kernels::squares_max_blocks) * sizeof(double)));
  double* result = partial + backend::cuda::kernels::squares_max_blocks;
  backend::cuda::kernels::sum_of_squares(be.context(), backend::cuda::detail::device_ptr(x.data()), x.numel(), partial, result);
  return be.context().read_scalar(result);
}

/// The same sum enqueued into *out (a double of this context's device memory), without waiting: a
/// caller combining several reads them back with one copy (pipeline::GradientSquares). An empty x
/// writes 0.
template <class T, class C, class V>
  requires backend::cuda::detail::either_precision<V, T, C>
void sum_of_squares_into(backend::Cuda<T, C>& be, TensorView<V, DeviceSpace> x_view, double* out) {
  const DeviceConstView<std::remove_const_t<V>> x = x_view;
  checks::sum_of_squares(x);
  CUPIPE_REQUIRE(out != nullptr, "sum_of_squares_into: no place for the result");
  const backend::cuda::detail::OpScope scope(be, "cupipe::sum_of_squares_into");
  if (x.numel() == 0) {
    CUPIPE_CHECK_CUDA(cudaMemsetAsync(out, 0, sizeof(double), be.context().stream()));
    return;
  }
  auto* partial = static_cast<double*>(be.context().scratch(std::size_t(backend::cuda::kernels::squares_max_blocks) * sizeof(double)));
  backend::cuda::kernels::sum_of_squares(be.context(), backend::cuda::detail::device_ptr(x.data()), x.numel(), partial, out);
}

/// On compute-type views (float master weights where the storage is bf16).
template <class T, class C, class S>
void sgd_update(backend::Cuda<T, C>& be, DeviceView<C> param, DeviceConstView<C> grad, DeviceView<C> velocity, const SgdHyper& h,
                S grad_scale) {
  checks::sgd_update(param, grad, velocity);
  const backend::cuda::detail::OpScope scope(be, "cupipe::sgd_update");
  using A = backend::cuda::kernels::acc_t<C>;
  const backend::cuda::kernels::SgdOp<C> op{A(C(h.lr)), A(C(h.momentum)), A(C(h.weight_decay)), A(backend::cuda::detail::acc<C>(grad_scale)), h.nesterov};
  backend::cuda::kernels::transform(be.context(), param.numel(), op, param.data(), grad.data(), velocity.data());
}

}  // namespace cupipe::ops
namespace cupipe::backend::cuda::detail {
/// AdamW's per-step scalars, rounded to the arithmetic type as the host op rounds them (`step` is checked).
template <class A>
backend::cuda::kernels::AdamWScalars<A> adamw_scalars(const ops::AdamWHyper& h, std::int64_t step, A grad_scale) {
  return {A(h.lr),
          A(h.beta1),
          A(1 - h.beta1),
          A(h.beta2),
          A(1 - h.beta2),
          A(h.eps),
          A(1) - A(std::pow(h.beta1, double(step))),
          A(1) - A(std::pow(h.beta2, double(step))),
          A(1) - A(h.lr * h.weight_decay),
          grad_scale};
}
}  // namespace cupipe::backend::cuda::detail
namespace cupipe::ops {

/// `step` counts from 1 (the first update uses step 1 for the bias corrections). On compute-type
/// views (float master weights where the storage is bf16).
template <class T, class C, class S>
void adamw_update(backend::Cuda<T, C>& be, DeviceView<C> param, DeviceConstView<C> grad, DeviceView<C> m, DeviceView<C> v,
                  const AdamWHyper& h, std::int64_t step, S grad_scale) {
  checks::adamw_update(param, grad, m, v, step);
  const auto scalars = backend::cuda::detail::adamw_scalars<C>(h, step, C(backend::cuda::detail::acc<C>(grad_scale)));
  const backend::cuda::detail::OpScope scope(be, "cupipe::adamw_update");
  backend::cuda::kernels::transform(be.context(), param.numel(), backend::cuda::kernels::AdamWOp<C>{scalars}, param.data(), grad.data(), m.data(),
                           v.data());
}

/// AdamW for bf16 parameters with fp32 master weights: master, m and v are updated in fp32 and the
/// parameter is rewritten as master rounded to bf16. The gradient is a (const) float or bfloat16 view.
template <class T, class C, class G>
  requires(std::is_same_v<std::remove_const_t<G>, float> || std::is_same_v<std::remove_const_t<G>, bfloat16>)
void adamw_update_master(backend::Cuda<T, C>& be, DeviceView<float> master, DeviceView<bfloat16> param, DeviceView<G> grad,
                         DeviceView<float> m, DeviceView<float> v, const AdamWHyper& h, std::int64_t step,
                         float grad_scale) {
  check_view(master, master.shape(), "adamw_update_master", "master");
  check_view(param, master.shape(), "adamw_update_master", "param");
  check_view(grad, master.shape(), "adamw_update_master", "grad");
  check_view(m, master.shape(), "adamw_update_master", "m");
  check_view(v, master.shape(), "adamw_update_master", "v");
  checks::adamw_step(step);
  const auto scalars = backend::cuda::detail::adamw_scalars<float>(h, step, grad_scale);
  const backend::cuda::detail::OpScope scope(be, "cupipe::adamw_update_master");
  using DG = backend::cuda::kernels::device_t<std::remove_const_t<G>>;
  backend::cuda::kernels::transform(be.context(), master.numel(), backend::cuda::kernels::AdamWMasterOp<DG>{scalars}, master.data(),
                           backend::cuda::detail::device_ptr(param.data()), backend::cuda::detail::cptr(grad), m.data(), v.data());
}

}  // namespace cupipe::ops

// Causal self-attention, the op with the most paths, in a file of its own.
#include "cupipe/backend/cuda/attention_op.cuh"

// A mixture of experts' token movement (moe_permute, moe_unpermute and their backwards).
#include "cupipe/backend/cuda/ops_moe.cuh"

// Context parallelism's ring attention (ring_attention_forward and its backward).
#include "cupipe/backend/cuda/ops_ring.cuh"
