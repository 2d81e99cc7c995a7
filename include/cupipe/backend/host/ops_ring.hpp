// SPDX-License-Identifier: Apache-2.0
// Context parallelism's ring attention as an op of the host backend: the views' checks
// (backend/op_checks.hpp), then the ring of host ranks (cp/ring_layer.hpp, which passes the keys and
// values round `ring` and runs cp/ring_attention.hpp's blocks). The attention layer calls it where
// its backend context has a ring (layers/attention.hpp); the CUDA op of the same name is
// backend/cuda/ops_ring.cuh, checked against this one.
//   ring_attention_forward   qkv (rows, 3C) -> out (rows, C), lse (rows, heads)
//   ring_attention_backward  dout (rows, C) -> dqkv (rows, 3C), from the forward's out and lse
// The rows are this rank's shares of sequences of `seq_len` tokens (cp::local_rows).
#pragma once

#include "cupipe/backend/host/host.hpp"
#include "cupipe/backend/op_checks.hpp"
#include "cupipe/core/tensor.hpp"
#include "cupipe/cp/context_group.hpp"
#include "cupipe/cp/ring_layer.hpp"

namespace cupipe::ops {

template <class T>
void ring_attention_forward(backend::Host<T>&, cp::ContextGroup& ring, ConstView<T> qkv, TensorView<T> out, TensorView<T> lse,
                            index_t heads, index_t seq_len) {
  checks::ring_attention_forward(qkv, out, lse, heads, seq_len, ring.size());
  cp::ring_attention_forward(ring, qkv.data(), qkv.rows(), seq_len, qkv.cols() / 3, heads, out.data(), lse.data());
}

template <class T>
void ring_attention_backward(backend::Host<T>&, cp::ContextGroup& ring, ConstView<T> qkv, ConstView<T> out, ConstView<T> lse,
                             ConstView<T> dout, TensorView<T> dqkv, index_t heads, index_t seq_len) {
  checks::ring_attention_backward(qkv, out, lse, dout, dqkv, heads, seq_len, ring.size());
  cp::ring_attention_backward(ring, qkv.data(), qkv.rows(), seq_len, qkv.cols() / 3, heads, out.data(), lse.data(), dout.data(),
                              dqkv.data());
}

}  // namespace cupipe::ops
