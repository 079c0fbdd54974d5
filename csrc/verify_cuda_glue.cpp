// CUDA bindings of the verify ops: validate on the host, launch on the current stream,
// check the launch status. Compiled only into CUDA builds (WITH_CUDA, see setup_ext.py);
// the kernels themselves are in verify_cuda.cu, which does not see torch.
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>

#include "verify_checks.h"
#include "verify_common.h"

namespace megatron_tlt {
namespace {

constexpr const char* kGreedyOp = "megatron_tlt::verify_tree_greedy";
constexpr const char* kRejectionOp = "megatron_tlt::verify_tree_rejection";

bool split_path_enabled() {
  const char* v = std::getenv("MEGATRON_TLT_VERIFY_SPLIT");
  return v == nullptr || std::string(v) != "0";
}

void check_launch(const char* op, int status) {
  const auto err = static_cast<cudaError_t>(status);
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorName(err),
              " (", cudaGetErrorString(err), ")");
}

void verify_tree_greedy_cuda(const at::Tensor& parents, const at::Tensor& draft_tokens,
                             const at::Tensor& target_probs, const at::Tensor& accept_index,
                             const at::Tensor& accept_length, const at::Tensor& output_tokens) {
  TORCH_CHECK(target_probs.is_cuda(), kGreedyOp, ": CUDA kernel got ", target_probs.device());
  const VerifySizes s =
      check_verify_args(kGreedyOp, parents, draft_tokens, target_probs, std::nullopt, nullptr,
                        nullptr, accept_index, accept_length, output_tokens);
  TORCH_CHECK(s.batch <= INT32_MAX, kGreedyOp, ": batch ", s.batch, " exceeds the grid limit");
  const c10::cuda::CUDAGuard guard(target_probs.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  check_launch(kGreedyOp,
               megatron_tlt_launch_verify_greedy(
                   parents.data_ptr<int64_t>(), draft_tokens.data_ptr<int64_t>(),
                   target_probs.data_ptr<float>(), s.batch, s.num_nodes, s.vocab, s.out_len,
                   accept_index.data_ptr<int64_t>(), accept_length.data_ptr<int64_t>(),
                   output_tokens.data_ptr<int64_t>(), stream));
}

void verify_tree_rejection_cuda(const at::Tensor& parents, const at::Tensor& draft_tokens,
                                const at::Tensor& target_probs,
                                const std::optional<at::Tensor>& draft_probs,
                                const at::Tensor& coins, const at::Tensor& exp_noise,
                                const at::Tensor& accept_index, const at::Tensor& accept_length,
                                const at::Tensor& output_tokens) {
  TORCH_CHECK(target_probs.is_cuda(), kRejectionOp, ": CUDA kernel got ",
              target_probs.device());
  const VerifySizes s =
      check_verify_args(kRejectionOp, parents, draft_tokens, target_probs, draft_probs, &coins,
                        &exp_noise, accept_index, accept_length, output_tokens);
  TORCH_CHECK(s.batch <= INT32_MAX, kRejectionOp, ": batch ", s.batch,
              " exceeds the grid limit");
  const bool general = draft_probs.has_value() && draft_probs->defined();
  TORCH_CHECK(general || s.num_nodes <= megatron_tlt_cuda_max_nodes(), kRejectionOp,
              ": num_nodes ", s.num_nodes, " exceeds the CUDA kernel's limit of ",
              megatron_tlt_cuda_max_nodes(), " for one-hot proposals (draft_probs=None)");
  const c10::cuda::CUDAGuard guard(target_probs.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Scratch for the general-q residual; from the caching allocator (the graph's private
  // pool under CUDA-graph capture), so no host sync.
  at::Tensor work;
  if (general) work = at::empty({s.batch, s.vocab}, target_probs.options());
  // The split path (chains: the vocabulary over many blocks per row) unless
  // MEGATRON_TLT_VERIFY_SPLIT=0 (one block per row, the original kernel).
  at::Tensor split;
  const int64_t split_bytes = split_path_enabled()
                                  ? megatron_tlt_verify_rejection_split_bytes(s.batch, s.vocab)
                                  : 0;
  if (split_bytes > 0) {
    split = at::empty({(split_bytes + 7) / 8}, target_probs.options().dtype(at::kLong));
  }
  check_launch(kRejectionOp,
               megatron_tlt_launch_verify_rejection(
                   parents.data_ptr<int64_t>(), draft_tokens.data_ptr<int64_t>(),
                   target_probs.data_ptr<float>(),
                   general ? draft_probs->data_ptr<float>() : nullptr, coins.data_ptr<float>(),
                   exp_noise.data_ptr<float>(), general ? work.data_ptr<float>() : nullptr,
                   split_bytes > 0 ? split.data_ptr() : nullptr,
                   s.batch, s.num_nodes, s.vocab, s.out_len, accept_index.data_ptr<int64_t>(),
                   accept_length.data_ptr<int64_t>(), output_tokens.data_ptr<int64_t>(), stream));
}

}  // namespace
}  // namespace megatron_tlt

TORCH_LIBRARY_IMPL(megatron_tlt, CUDA, m) {
  m.impl("verify_tree_greedy", &megatron_tlt::verify_tree_greedy_cuda);
  m.impl("verify_tree_rejection", &megatron_tlt::verify_tree_rejection_cuda);
}
