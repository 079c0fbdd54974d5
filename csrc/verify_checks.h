// Host-side argument validation shared by the CPU and CUDA bindings of the verify ops.
//
// Only metadata is checked here (dtype, rank, shape, device, contiguity): it is free and
// needs no device sync, so it runs on every call, including under CUDA-graph capture.
// Tree contents (parent indices, token range) are not errors for the kernels: invalid
// nodes are padding by definition (see verify_common.h); the Python wrapper
// (megatron_tlt/spec/verify.py, validate=True) rejects malformed trees with a clear error.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <optional>

#include <string>

namespace megatron_tlt {

struct VerifySizes {
  int64_t batch;
  int64_t num_nodes;
  int64_t vocab;
  int64_t out_len;  // max_depth + 1
};

inline void check_tensor(const char* op, const char* name, const at::Tensor& t,
                         at::ScalarType dtype, int64_t dim, const at::Device& device) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must have ", dim, " dimensions, got shape ",
              t.sizes());
  TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(),
              " but target_probs is on ", device, " (all arguments must share one device)");
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (shape ", t.sizes(),
              ", strides ", t.strides(), ")");
}

inline void check_size(const char* op, const char* name, const at::Tensor& t, int64_t d,
                       int64_t expected, const char* what) {
  TORCH_CHECK(t.size(d) == expected, op, ": ", name, ".size(", d, ") must equal ", what, " (",
              expected, "), got shape ", t.sizes());
}

// Validates every argument of verify_tree_greedy / verify_tree_rejection.
// coins/exp_noise are undefined for the greedy op.
inline VerifySizes check_verify_args(const char* op, const at::Tensor& parents,
                                     const at::Tensor& draft_tokens,
                                     const at::Tensor& target_probs,
                                     const std::optional<at::Tensor>& draft_probs,
                                     const at::Tensor* coins, const at::Tensor* exp_noise,
                                     const at::Tensor& accept_index,
                                     const at::Tensor& accept_length,
                                     const at::Tensor& output_tokens) {
  TORCH_CHECK(target_probs.defined(), op, ": target_probs is undefined");
  const at::Device device = target_probs.device();
  check_tensor(op, "target_probs [batch, num_nodes, vocab]", target_probs, at::kFloat, 3, device);
  const int64_t batch = target_probs.size(0);
  const int64_t num_nodes = target_probs.size(1);
  const int64_t vocab = target_probs.size(2);
  TORCH_CHECK(num_nodes >= 1, op, ": num_nodes must be >= 1 (node 0 is the root), got shape ",
              target_probs.sizes());
  TORCH_CHECK(vocab >= 1, op, ": vocab must be >= 1, got shape ", target_probs.sizes());

  check_tensor(op, "parents [batch, num_nodes]", parents, at::kLong, 2, device);
  check_size(op, "parents", parents, 0, batch, "batch");
  check_size(op, "parents", parents, 1, num_nodes, "num_nodes");
  check_tensor(op, "draft_tokens [batch, num_nodes]", draft_tokens, at::kLong, 2, device);
  check_size(op, "draft_tokens", draft_tokens, 0, batch, "batch");
  check_size(op, "draft_tokens", draft_tokens, 1, num_nodes, "num_nodes");

  if (draft_probs.has_value() && draft_probs->defined()) {
    const at::Tensor& q = *draft_probs;
    check_tensor(op, "draft_probs [batch, num_nodes, vocab]", q, at::kFloat, 3, device);
    TORCH_CHECK(q.sizes() == target_probs.sizes(), op,
                ": draft_probs must have the shape of target_probs ", target_probs.sizes(),
                ", got ", q.sizes());
  }
  if (coins != nullptr) {
    check_tensor(op, "coins [batch, num_nodes]", *coins, at::kFloat, 2, device);
    check_size(op, "coins", *coins, 0, batch, "batch");
    check_size(op, "coins", *coins, 1, num_nodes, "num_nodes");
  }
  if (exp_noise != nullptr) {
    check_tensor(op, "exp_noise [batch, vocab]", *exp_noise, at::kFloat, 2, device);
    check_size(op, "exp_noise", *exp_noise, 0, batch, "batch");
    check_size(op, "exp_noise", *exp_noise, 1, vocab, "vocab");
  }

  check_tensor(op, "accept_index [batch, max_depth + 1]", accept_index, at::kLong, 2, device);
  check_size(op, "accept_index", accept_index, 0, batch, "batch");
  const int64_t out_len = accept_index.size(1);
  TORCH_CHECK(out_len >= 1, op, ": accept_index needs max_depth + 1 >= 1 columns, got shape ",
              accept_index.sizes());
  check_tensor(op, "accept_length [batch]", accept_length, at::kLong, 1, device);
  check_size(op, "accept_length", accept_length, 0, batch, "batch");
  check_tensor(op, "output_tokens [batch, max_depth + 1]", output_tokens, at::kLong, 2, device);
  check_size(op, "output_tokens", output_tokens, 0, batch, "batch");
  check_size(op, "output_tokens", output_tokens, 1, out_len, "accept_index.size(1)");
  return VerifySizes{batch, num_nodes, vocab, out_len};
}

}  // namespace megatron_tlt
