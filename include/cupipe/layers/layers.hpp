// SPDX-License-Identifier: Apache-2.0
// Every layer, Sequential and Network.
#pragma once

#include "cupipe/layers/activation.hpp"
#include "cupipe/layers/attention.hpp"
#include "cupipe/layers/embedding.hpp"
#include "cupipe/layers/layer.hpp"
#include "cupipe/layers/layernorm.hpp"
#include "cupipe/layers/linear.hpp"
#include "cupipe/layers/loss.hpp"
#include "cupipe/layers/moe.hpp"
#include "cupipe/layers/named.hpp"
#include "cupipe/layers/network.hpp"
#include "cupipe/layers/residual.hpp"
#include "cupipe/layers/sequential.hpp"
#include "cupipe/layers/tensor_parallel.hpp"
