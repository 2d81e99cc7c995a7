// SPDX-License-Identifier: Apache-2.0
// cuDNN's fused causal attention through the frontend's graph API: the one translation unit that
// includes cudnn_frontend.h (include/cupipe/backend/cuda/cudnn_attention.hpp says why and what).
// The graphs follow the frontend's SDPA samples and llm.c's cudnn_att.cpp: Q, K and V read by strides
// from the packed qkv rows, O and dO (B, T, H, D), statistics (B, H, T, 1) fp32, intermediate and
// compute types fp32, causal mask (top-left diagonal, right bound 0), deterministic backward.
#include "cupipe/backend/cuda/cudnn_attention.hpp"

#include <cudnn.h>
#include <cudnn_frontend.h>

#include <array>
#include <cmath>
#include <map>
#include <sstream>
#include <unordered_map>

#include "cupipe/core/error.hpp"

namespace cupipe::backend::cuda::cudnn_attention {

namespace fe = cudnn_frontend;

namespace {

enum Uid : std::int64_t { q_uid = 1, k_uid, v_uid, o_uid, stats_uid, do_uid, dq_uid, dk_uid, dv_uid };

std::string describe(Sizes s) {
  std::ostringstream out;
  out << "B " << s.batch << ", T " << s.seq_len << ", H " << s.heads << ", D " << s.head_dim;
  return out.str();
}

/// A frontend call's status as a line: empty when it succeeded.
std::string failure(const fe::error_object& status, const char* call) {
  if (status.is_good()) return {};
  return std::string(call) + ": " + status.err_msg;
}

[[noreturn]] void throw_cudnn(cudnnStatus_t status, const char* call, const char* file, int line) {
  ::cupipe::detail::throw_error(std::string("cuDNN status ") + std::to_string(int(status)) + ": " + cudnnGetErrorString(status),
                                call, file, line);
}

#define CUPIPE_CHECK_CUDNN(call)                                                      \
  do {                                                                                \
    const cudnnStatus_t cupipe_status_ = (call);                                      \
    if (cupipe_status_ != CUDNN_STATUS_SUCCESS) [[unlikely]]                          \
      throw_cudnn(cupipe_status_, #call, __FILE__, __LINE__);                         \
  } while (0)

/// Strides of a (B, H, T, D) view into rows of `row` elements: sequence, head, token, column.
std::vector<std::int64_t> rows_of(Sizes s, std::int64_t row) { return {s.seq_len * row, s.head_dim, row, 1}; }
std::vector<std::int64_t> dims(Sizes s) { return {s.batch, s.heads, s.seq_len, s.head_dim}; }
std::vector<std::int64_t> stats_dims(Sizes s) { return {s.batch, s.heads, s.seq_len, 1}; }
std::vector<std::int64_t> stats_strides(Sizes s) { return {s.heads * s.seq_len, s.seq_len, 1, 1}; }

std::shared_ptr<fe::graph::Graph> new_graph() {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return graph;
}

std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph& g, const char* name, Uid uid, std::vector<std::int64_t> dim,
                                                    std::vector<std::int64_t> stride) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(std::move(dim)).set_stride(std::move(stride)));
}

/// Q, K and V of one graph, read by strides from the packed qkv rows (3 C wide).
std::array<std::shared_ptr<fe::graph::Tensor_attributes>, 3> qkv_inputs(fe::graph::Graph& g, Sizes s) {
  const std::int64_t row = 3 * s.heads * s.head_dim;
  return {input(g, "Q", q_uid, dims(s), rows_of(s, row)), input(g, "K", k_uid, dims(s), rows_of(s, row)),
          input(g, "V", v_uid, dims(s), rows_of(s, row))};
}

float scale_of(Sizes s) { return 1.0f / std::sqrt(float(s.head_dim)); }

/// Validates and builds a graph (the slow part); the first failing step's message, or empty.
std::string build(fe::graph::Graph& graph, cudnnHandle_t handle) {
  if (auto why = failure(graph.validate(), "validate"); !why.empty()) return why;
  if (auto why = failure(graph.build_operation_graph(handle), "build_operation_graph"); !why.empty()) return why;
  if (auto why = failure(graph.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), "create_execution_plans");
      !why.empty())
    return why;
  if (auto why = failure(graph.check_support(handle), "check_support"); !why.empty()) return why;
  return failure(graph.build_plans(handle), "build_plans");
}

std::shared_ptr<fe::graph::Graph> forward_graph(Sizes s, cudnnHandle_t handle, std::string& why) {
  auto graph = new_graph();
  const std::int64_t C = s.heads * s.head_dim;
  auto [q, k, v] = qkv_inputs(*graph, s);
  auto options = fe::graph::SDPA_attributes()
                     .set_name("cupipe_causal_attention")
                     .set_generate_stats(true)
                     .set_attn_scale(scale_of(s))
                     .set_causal_mask(true);
  auto [o, stats] = graph->sdpa(q, k, v, options);
  o->set_output(true).set_uid(o_uid).set_dim(dims(s)).set_stride(rows_of(s, C));
  stats->set_output(true).set_uid(stats_uid).set_data_type(fe::DataType_t::FLOAT).set_dim(stats_dims(s)).set_stride(stats_strides(s));
  why = build(*graph, handle);
  return why.empty() ? graph : nullptr;
}

std::shared_ptr<fe::graph::Graph> backward_graph(Sizes s, cudnnHandle_t handle, std::string& why) {
  auto graph = new_graph();
  const std::int64_t C = s.heads * s.head_dim;
  auto [q, k, v] = qkv_inputs(*graph, s);
  auto o = input(*graph, "O", o_uid, dims(s), rows_of(s, C));
  auto d_o = input(*graph, "dO", do_uid, dims(s), rows_of(s, C));
  auto stats = input(*graph, "Stats", stats_uid, stats_dims(s), stats_strides(s));
  stats->set_data_type(fe::DataType_t::FLOAT);
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("cupipe_causal_attention_backward")
                     .set_attn_scale(scale_of(s))
                     .set_causal_mask(true)
                     .set_deterministic_algorithm(true);
  auto [dq, dk, dv] = graph->sdpa_backward(q, k, v, o, d_o, stats, options);
  dq->set_output(true).set_uid(dq_uid).set_dim(dims(s)).set_stride(rows_of(s, 3 * C));
  dk->set_output(true).set_uid(dk_uid).set_dim(dims(s)).set_stride(rows_of(s, 3 * C));
  dv->set_output(true).set_uid(dv_uid).set_dim(dims(s)).set_stride(rows_of(s, 3 * C));
  why = build(*graph, handle);
  return why.empty() ? graph : nullptr;
}

}  // namespace

class Engine {
 public:
  Engine() {
    CUPIPE_CHECK_CUDNN(cudnnCreate(&handle_));
  }
  ~Engine() { (void)cudnnDestroy(handle_); }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  struct Graphs {
    std::shared_ptr<fe::graph::Graph> forward, backward;
    std::string refusal;
    std::size_t forward_workspace = 0, backward_workspace = 0;
  };

  /// Both graphs for these sizes, built on first use; a refusal is kept too, so it is asked once.
  const Graphs& graphs(Sizes s) {
    auto found = cache_.find(s);
    if (found != cache_.end()) return found->second;
    Graphs made;
    if (s.batch <= 0 || s.seq_len <= 0 || s.heads <= 0 || s.head_dim <= 0) {
      made.refusal = "sizes must be positive (" + describe(s) + ")";
    } else {
      std::string why;
      made.forward = forward_graph(s, handle_, why);
      if (!why.empty()) made.refusal = "forward: " + why;
      if (made.forward) {
        made.backward = backward_graph(s, handle_, why);
        if (!why.empty()) made.refusal = "backward: " + why;
      }
      if (made.refusal.empty()) {
        made.forward_workspace = std::size_t(made.forward->get_workspace_size());
        made.backward_workspace = std::size_t(made.backward->get_workspace_size());
      } else {
        made.forward.reset();
        made.backward.reset();
      }
    }
    return cache_.emplace(s, std::move(made)).first->second;
  }

  const Graphs& usable(Sizes s, const char* op) {
    const Graphs& g = graphs(s);
    if (!g.refusal.empty()) CUPIPE_THROW(op, ": cuDNN refused attention of ", describe(s), ": ", g.refusal);
    return g;
  }

  void run(const fe::graph::Graph& graph, cudaStream_t stream, std::unordered_map<std::int64_t, void*>& pack, void* workspace,
           Sizes s, const char* op) {
    CUPIPE_CHECK_CUDNN(cudnnSetStream(handle_, stream));
    const fe::error_object status = graph.execute(handle_, pack, workspace);
    if (!status.is_good()) CUPIPE_THROW(op, ": cuDNN's execute failed for ", describe(s), ": ", status.err_msg);
  }

 private:
  cudnnHandle_t handle_ = nullptr;
  std::map<Sizes, Graphs> cache_;
};

void EngineDeleter::operator()(Engine* engine) const noexcept { delete engine; }

EnginePtr make_engine() { return EnginePtr(new Engine()); }

std::size_t library_version() noexcept { return cudnnGetVersion(); }
std::size_t frontend_version() noexcept { return CUDNN_FRONTEND_VERSION; }

std::string refusal(Engine& engine, Sizes sizes) { return engine.graphs(sizes).refusal; }

std::size_t forward_workspace(Engine& engine, Sizes sizes) { return engine.graphs(sizes).forward_workspace; }
std::size_t backward_workspace(Engine& engine, Sizes sizes) { return engine.graphs(sizes).backward_workspace; }

void forward(Engine& engine, cudaStream_t stream, Sizes s, const void* qkv, void* out, float* stats, void* workspace) {
  constexpr const char* op = "cudnn_attention::forward";
  const auto& g = engine.usable(s, op);
  const std::int64_t C = s.heads * s.head_dim;
  auto* base = static_cast<std::byte*>(const_cast<void*>(qkv));
  constexpr std::int64_t bf16 = 2;  // bytes of one element
  std::unordered_map<std::int64_t, void*> pack = {
      {q_uid, base}, {k_uid, base + C * bf16}, {v_uid, base + 2 * C * bf16}, {o_uid, out}, {stats_uid, stats}};
  engine.run(*g.forward, stream, pack, workspace, s, op);
}

void backward(Engine& engine, cudaStream_t stream, Sizes s, const void* qkv, const void* out, const float* stats,
              const void* dout, void* dqkv, void* workspace) {
  constexpr const char* op = "cudnn_attention::backward";
  const auto& g = engine.usable(s, op);
  const std::int64_t C = s.heads * s.head_dim;
  auto* base = static_cast<std::byte*>(const_cast<void*>(qkv));
  auto* dbase = static_cast<std::byte*>(dqkv);
  constexpr std::int64_t bf16 = 2;
  std::unordered_map<std::int64_t, void*> pack = {
      {q_uid, base},           {k_uid, base + C * bf16},   {v_uid, base + 2 * C * bf16},
      {o_uid, const_cast<void*>(out)}, {do_uid, const_cast<void*>(dout)}, {stats_uid, const_cast<float*>(stats)},
      {dq_uid, dbase},         {dk_uid, dbase + C * bf16}, {dv_uid, dbase + 2 * C * bf16}};
  engine.run(*g.backward, stream, pack, workspace, s, op);
}

}  // namespace cupipe::backend::cuda::cudnn_attention
