// SPDX-License-Identifier: Apache-2.0
// Fused optimizer updates, one pass over parameters and their state (kernels/elementwise.cuh's
// transform). The arithmetic follows ops::SgdHyper and ops::AdamWHyper term by term.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cupipe/backend/cuda/kernels/common.cuh"

namespace cupipe::backend::cuda::kernels {

template <class T>
struct SgdOp {
  using A = acc_t<T>;
  A lr, momentum, weight_decay, grad_scale;
  bool nesterov;
  __device__ void operator()(T& param, const T& grad, T& velocity) const {
    const A p = to_acc(param);
    const A g = to_acc(grad) * grad_scale + weight_decay * p;
    const A v = momentum * to_acc(velocity) + g;
    velocity = from_acc<T>(v);
    param = from_acc<T>(p - lr * (nesterov ? g + momentum * v : v));
  }
};

/// Scalars of one AdamW step, precomputed on the host in the parameter's arithmetic type.
template <class A>
struct AdamWScalars {
  A lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, bias1, bias2, decay, grad_scale;
};

template <class A>
__device__ __forceinline__ A adamw_step(const AdamWScalars<A>& s, A p, A g, A& m, A& v) {
  g *= s.grad_scale;
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * g * g;
  const A mhat = m / s.bias1, vhat = v / s.bias2;
  return p * s.decay - s.lr * mhat / (dev_sqrt(vhat) + s.eps);
}

template <class T>
struct AdamWOp {
  AdamWScalars<acc_t<T>> s;
  __device__ void operator()(T& param, const T& grad, T& m, T& v) const {
    acc_t<T> mm = to_acc(m), vv = to_acc(v);
    param = from_acc<T>(adamw_step(s, to_acc(param), to_acc(grad), mm, vv));
    m = from_acc<T>(mm);
    v = from_acc<T>(vv);
  }
};

/// Mixed precision: the fp32 master weight is updated and the bf16 parameter is its rounding.
template <class G>
struct AdamWMasterOp {
  AdamWScalars<float> s;
  __device__ void operator()(float& master, __nv_bfloat16& param, const G& grad, float& m, float& v) const {
    master = adamw_step(s, master, float(to_acc(grad)), m, v);
    param = __float2bfloat16_rn(master);
  }
};

}  // namespace cupipe::backend::cuda::kernels
