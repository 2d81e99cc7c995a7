// SPDX-License-Identifier: Apache-2.0
// A mixture of experts' token movement on the host: each token's kept choices to their expert-sorted
// rows and back (layers/moe.hpp calls them between its router and its experts' GEMMs). They are the
// references of the CUDA kernels (backend/cuda/kernels/moe.cuh).
//
// slots (n, k): the row among the S expert-sorted rows where token t's choice j sits, or -1 where the
// choice was dropped (moe::dispatch); gates (n, k): the choices' weights.
//   moe_permute             xs[slots_tj] = x_t
//   moe_unpermute           y_t = sum_j gates_tj o[slots_tj], in choice order from 0
//   moe_unpermute_backward  d_o[slots_tj] = gates_tj dy_t;  dgates_tj = dy_t . o[slots_tj] (0 where dropped)
//   moe_permute_backward    dx_t += sum_j dxs[slots_tj], in choice order
// A slot outside [-1, S) is an error naming the op, the choice and the slot.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>

#include "cupipe/backend/host/host.hpp"
#include "cupipe/backend/op_checks.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe::ops {

namespace detail {
/// The slot of choice i (row-major in slots), checked against [-1, rows).
inline std::int32_t moe_slot(std::string_view op, ConstView<std::int32_t> slots, index_t i, index_t rows) {
  const std::int32_t at = slots.data()[i];
  if (at < -1 || at >= rows) checks::moe_slot_out_of_range(op, at, i, rows);
  return at;
}
}  // namespace detail

template <class T>
void moe_permute(backend::Host<T>&, ConstView<T> x, ConstView<std::int32_t> slots, TensorView<T> xs) {
  checks::moe_permute(x, slots, xs);
  const index_t n = x.rows(), k = slots.cols(), c = x.cols();
  for (index_t t = 0; t < n; ++t)
    for (index_t j = 0; j < k; ++j) {
      const std::int32_t at = detail::moe_slot("moe_permute", slots, t * k + j, xs.rows());
      if (at < 0) continue;
      std::copy_n(x.data() + t * c, c, xs.data() + index_t(at) * c);
    }
}

template <class T>
void moe_unpermute(backend::Host<T>&, ConstView<T> o, ConstView<std::int32_t> slots, ConstView<T> gates, TensorView<T> y) {
  checks::moe_unpermute(o, slots, gates, y);
  const index_t n = slots.rows(), k = slots.cols(), c = o.cols();
  for (index_t t = 0; t < n; ++t) {
    T* yt = y.data() + t * c;
    std::fill_n(yt, c, T(0));
    for (index_t j = 0; j < k; ++j) {
      const std::int32_t at = detail::moe_slot("moe_unpermute", slots, t * k + j, o.rows());
      if (at < 0) continue;
      const T g = gates.data()[t * k + j];
      const T* ot = o.data() + index_t(at) * c;
      for (index_t i = 0; i < c; ++i) yt[i] += g * ot[i];
    }
  }
}

template <class T>
void moe_unpermute_backward(backend::Host<T>&, ConstView<T> dy, ConstView<T> o, ConstView<std::int32_t> slots,
                            ConstView<T> gates, TensorView<T> d_o, TensorView<T> dgates) {
  checks::moe_unpermute_backward(dy, o, slots, gates, d_o, dgates);
  const index_t n = slots.rows(), k = slots.cols(), c = o.cols();
  for (index_t t = 0; t < n; ++t)
    for (index_t j = 0; j < k; ++j) {
      const std::int32_t at = detail::moe_slot("moe_unpermute_backward", slots, t * k + j, o.rows());
      T acc = 0;
      if (at >= 0) {
        const T* dyt = dy.data() + t * c;
        const T* ot = o.data() + index_t(at) * c;
        T* d_ot = d_o.data() + index_t(at) * c;
        const T g = gates.data()[t * k + j];
        for (index_t i = 0; i < c; ++i) {
          acc += dyt[i] * ot[i];
          d_ot[i] = g * dyt[i];
        }
      }
      dgates.data()[t * k + j] = acc;
    }
}

template <class T>
void moe_permute_backward(backend::Host<T>&, ConstView<T> dxs, ConstView<std::int32_t> slots, TensorView<T> dx) {
  checks::moe_permute_backward(dxs, slots, dx);
  const index_t n = slots.rows(), k = slots.cols(), c = dxs.cols();
  for (index_t t = 0; t < n; ++t)
    for (index_t j = 0; j < k; ++j) {
      const std::int32_t at = detail::moe_slot("moe_permute_backward", slots, t * k + j, dxs.rows());
      if (at < 0) continue;
      const T* d = dxs.data() + index_t(at) * c;
      T* dxt = dx.data() + t * c;
      for (index_t i = 0; i < c; ++i) dxt[i] += d[i];
    }
}

}  // namespace cupipe::ops
