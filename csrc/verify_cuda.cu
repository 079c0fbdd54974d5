// CUDA kernels of the speculative-decoding verify ops, and plain C launchers for them.
//
// No torch here: this file includes only the CUDA runtime and verify_common.h, so CI
// compiles it with a bare nvcc (tests/unit/spec/test_cuda_compiles.py) even where torch
// is a CPU build. The torch glue is verify_cuda_glue.cpp.
//
// One block per sequence. The tree walk is sequential by nature, so every thread runs it
// in lockstep (all branch conditions are uniform: they depend only on values every
// thread reads), and the threads cooperate over the vocabulary for the three O(vocab)
// steps: argmax (greedy), the residual update (general proposals) and the exponential
// race. Reductions are deterministic: argmax by the total order tlt_better, masses by
// exact fixed-point integer sums. Semantics: megatron_tlt/spec/verify_ref.py.
#include <cuda_runtime.h>
#include <stdint.h>

#include "verify_common.h"

namespace megatron_tlt {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxNodes = 4096;  // capacity of the one-hot rejected-token list
constexpr unsigned kFullMask = 0xffffffffu;

struct ArgBest {
  float score;
  long long index;
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ void warp_argbest(float& s, long long& i) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float s2 = __shfl_down_sync(kFullMask, s, offset);
    const long long i2 = __shfl_down_sync(kFullMask, i, offset);
    if (tlt_better(s2, i2, s, i)) {
      s = s2;
      i = i2;
    }
  }
}

// Block-wide argmax under tlt_better; every thread gets the result. The order is total,
// so the winner does not depend on the reduction tree.
__device__ ArgBest block_argbest(float s, long long i, ArgBest* smem) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  warp_argbest(s, i);
  if (lane == 0) smem[warp] = ArgBest{s, i};
  __syncthreads();
  if (warp == 0) {
    s = lane < kWarps ? smem[lane].score : neg_inf();
    i = lane < kWarps ? smem[lane].index : INT64_MAX;
    warp_argbest(s, i);
    if (lane == 0) smem[0] = ArgBest{s, i};
  }
  __syncthreads();
  const ArgBest result = smem[0];
  __syncthreads();  // smem is reused by the next reduction
  return result;
}

// Block-wide sum of uint64 (mod 2^64: exact and order-independent).
__device__ unsigned long long block_sum(unsigned long long x, unsigned long long* smem) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_down_sync(kFullMask, x, offset);
  if (lane == 0) smem[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < kWarps ? smem[lane] : 0ull;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_down_sync(kFullMask, x, offset);
    if (lane == 0) smem[0] = x;
  }
  __syncthreads();
  const unsigned long long result = smem[0];
  __syncthreads();
  return result;
}

__device__ __forceinline__ bool list_contains(const int64_t* xs, int n, int64_t x) {
  for (int k = 0; k < n; ++k) {
    if (xs[k] == x) return true;
  }
  return false;
}

__device__ __forceinline__ bool is_child(const int64_t* parents, const int64_t* tokens,
                                         int64_t c, int64_t cur, int64_t vocab) {
  return tlt_node_valid(c, parents[c], tokens[c], vocab) && parents[c] == cur;
}

__device__ void reset_outputs(int64_t* accept_index, int64_t* output_tokens, int64_t out_len) {
  for (int64_t i = threadIdx.x; i < out_len; i += kThreads) {
    accept_index[i] = i == 0 ? 0 : -1;
    output_tokens[i] = -1;
  }
  __syncthreads();  // thread 0 overwrites some of these entries later
}

__global__ void __launch_bounds__(kThreads)
    verify_greedy_kernel(const int64_t* __restrict__ parents_all,
                         const int64_t* __restrict__ tokens_all,
                         const float* __restrict__ target_all, int64_t num_nodes, int64_t vocab,
                         int64_t out_len, int64_t* __restrict__ accept_index_all,
                         int64_t* __restrict__ accept_length,
                         int64_t* __restrict__ output_tokens_all) {
  __shared__ ArgBest red[kWarps];
  const int64_t b = blockIdx.x;
  const int64_t* parents = parents_all + b * num_nodes;
  const int64_t* tokens = tokens_all + b * num_nodes;
  const float* target = target_all + b * num_nodes * vocab;
  int64_t* accept_index = accept_index_all + b * out_len;
  int64_t* output_tokens = output_tokens_all + b * out_len;
  reset_outputs(accept_index, output_tokens, out_len);

  const int64_t max_depth = out_len - 1;
  int64_t cur = 0;
  int64_t depth = 0;
  while (true) {
    const float* p = target + cur * vocab;
    float s = neg_inf();
    long long i = INT64_MAX;
    for (int64_t v = threadIdx.x; v < vocab; v += kThreads) {
      const float sv = tlt_greedy_score(p[v]);
      if (tlt_better(sv, v, s, i)) {
        s = sv;
        i = v;
      }
    }
    const int64_t best = block_argbest(s, i, red).index;
    int64_t next = -1;
    if (depth < max_depth) {
      for (int64_t c = cur + 1; c < num_nodes; ++c) {
        if (is_child(parents, tokens, c, cur, vocab) && tokens[c] == best) {
          next = c;
          break;
        }
      }
    }
    if (next < 0) {
      if (threadIdx.x == 0) output_tokens[depth] = best;  // bonus token
      break;
    }
    if (threadIdx.x == 0) {
      output_tokens[depth] = tokens[next];
      accept_index[depth + 1] = next;
    }
    ++depth;
    cur = next;
  }
  if (threadIdx.x == 0) accept_length[b] = depth;
}

// Exponential race over this thread's share of the residual r; entries listed in
// `excluded` (one-hot rejected tokens) count as 0.
__device__ ArgBest race(const float* r, const float* noise, int64_t vocab,
                        const int64_t* excluded, int n_excluded, ArgBest* red) {
  float s = neg_inf();
  long long i = INT64_MAX;
  for (int64_t v = threadIdx.x; v < vocab; v += kThreads) {
    const float p = list_contains(excluded, n_excluded, v) ? 0.0f : r[v];
    const float sv = tlt_race_score(p, noise[v]);
    if (tlt_better(sv, v, s, i)) {
      s = sv;
      i = v;
    }
  }
  return block_argbest(s, i, red);
}

// The whole walk of row b by one block (any tree shape).
template <bool kOneHot>
__device__ void rejection_row(int64_t b, const int64_t* __restrict__ parents_all,
                              const int64_t* __restrict__ tokens_all,
                              const float* __restrict__ target_all,
                              const float* __restrict__ draft_all,
                              const float* __restrict__ coins_all,
                              const float* __restrict__ noise_all, float* work_all,
                              int64_t num_nodes, int64_t vocab, int64_t out_len,
                              int64_t* __restrict__ accept_index_all,
                              int64_t* __restrict__ accept_length,
                              int64_t* __restrict__ output_tokens_all) {
  __shared__ ArgBest red[kWarps];
  __shared__ unsigned long long sum_red[kWarps];
  __shared__ int64_t rejected[kOneHot ? kMaxNodes : 1];
  const int64_t* parents = parents_all + b * num_nodes;
  const int64_t* tokens = tokens_all + b * num_nodes;
  const float* target = target_all + b * num_nodes * vocab;
  const float* draft = kOneHot ? nullptr : draft_all + b * num_nodes * vocab;
  const float* coins = coins_all + b * num_nodes;
  const float* noise = noise_all + b * vocab;
  float* work = kOneHot ? nullptr : work_all + b * vocab;
  int64_t* accept_index = accept_index_all + b * out_len;
  int64_t* output_tokens = output_tokens_all + b * out_len;
  reset_outputs(accept_index, output_tokens, out_len);

  const int64_t max_depth = out_len - 1;
  int64_t cur = 0;
  int64_t depth = 0;
  while (true) {
    const float* r = target + cur * vocab;  // residual, unnormalised
    double mass = 1.0;                      // its mass
    int n_rejected = 0;
    int64_t next = -1;
    if (depth < max_depth) {
      for (int64_t c = cur + 1; c < num_nodes; ++c) {
        if (!is_child(parents, tokens, c, cur, vocab)) continue;
        const int64_t x = tokens[c];
        const float u = coins[c];
        if (kOneHot) {
          const float rx = list_contains(rejected, n_rejected, x) ? 0.0f : r[x];
          if (tlt_accept_one_hot(u, mass, rx)) {
            next = c;
            break;
          }
          mass = tlt_sub(mass, static_cast<double>(rx));
          __syncthreads();  // slow warps may still read this slot for an earlier node
          if (threadIdx.x == 0) rejected[n_rejected] = x;
          ++n_rejected;
          __syncthreads();
        } else {
          const float* q = draft + c * vocab;
          if (tlt_accept_general(u, q[x], mass, r[x])) {
            next = c;
            break;
          }
          __syncthreads();  // everyone has read r[x] before work (maybe r) is overwritten
          unsigned long long fixed = 0;
          for (int64_t v = threadIdx.x; v < vocab; v += kThreads) {
            const float w = tlt_residual_update(r[v], mass, q[v]);
            work[v] = w;
            fixed += tlt_fixed_from_prob(w);
          }
          mass = tlt_mass_from_fixed(block_sum(fixed, sum_red));  // syncs: work visible
          r = work;
        }
      }
    }
    if (next >= 0) {
      if (threadIdx.x == 0) {
        output_tokens[depth] = tokens[next];
        accept_index[depth + 1] = next;
      }
      ++depth;
      cur = next;
      continue;
    }
    // Recovered token (something was rejected here) or bonus token (nothing was).
    ArgBest w = race(r, noise, vocab, rejected, kOneHot ? n_rejected : 0, red);
    if (w.score < 0.0f) w = race(target + cur * vocab, noise, vocab, rejected, 0, red);
    if (threadIdx.x == 0) output_tokens[depth] = w.score < 0.0f ? 0 : w.index;
    break;
  }
  if (threadIdx.x == 0) accept_length[b] = depth;
}

template <bool kOneHot>
__global__ void __launch_bounds__(kThreads)
    verify_rejection_kernel(const int64_t* __restrict__ parents_all,
                            const int64_t* __restrict__ tokens_all,
                            const float* __restrict__ target_all,
                            const float* __restrict__ draft_all,
                            const float* __restrict__ coins_all,
                            const float* __restrict__ noise_all, float* work_all,
                            int64_t num_nodes, int64_t vocab, int64_t out_len,
                            int64_t* __restrict__ accept_index_all,
                            int64_t* __restrict__ accept_length,
                            int64_t* __restrict__ output_tokens_all) {
  rejection_row<kOneHot>(blockIdx.x, parents_all, tokens_all, target_all, draft_all, coins_all,
                         noise_all, work_all, num_nodes, vocab, out_len, accept_index_all,
                         accept_length, output_tokens_all);
}

// ---- Split path: chains with the vocabulary spread over many blocks -------------------
//
// With one block per sequence the O(vocab) steps run on one SM each: at batch 1 a chain
// verify over a 151,936-token vocabulary took ~190 us on the H200. For the rows whose
// walk never meets a node with two or more children (every chain, and a tree whose
// visited nodes have one child each), the work is:
//   walk: scalar accept tests down the chain; the residual mass is 1 at the first (and,
//         in a chain, only) rejection at a node, so no O(vocab) step is needed;
//   race: the exponential race over the rejected node's residual (or, when nothing was
//         rejected, the bonus race over the target row), plus the fallback race over the
//         target row for an all-zero residual.
// The race is an argmax under a total order, so it splits over vocabulary chunks exactly:
// split_race_kernel (grid batch x splits) runs the walk redundantly in every block (it
// reads only a few scalars), races its chunk and writes two partial winners; block 0 of
// a row also writes the accepted path. split_finish_kernel (grid batch) picks the row's
// winner from the partials, or runs rejection_row for a row whose walk met a branching
// node. Same outputs as rejection_row, bit for bit: the residual entries are the same
// tlt_residual_update(r, 1.0, q) values the sequential path stores in its workspace, and
// the one-hot exclusion list then holds only the rejected token.

constexpr int64_t kSplitChunk = 4 * kThreads;  // vocabulary entries per block
constexpr int64_t kMaxSplits = 256;

struct SplitPartial {
  ArgBest residual;  // winner of the race over the residual (or the target row: bonus)
  ArgBest plain;     // winner of the race over the target row (the all-zero fallback)
};

// Per row after the walk: [0] depth reached (accepted nodes), [1] 1 if the walk met a
// node with two or more valid children (the sequential path must run), [2] node whose
// row is raced, [3] rejected child (-1: none, bonus race).
constexpr int kRowInts = 4;

template <bool kOneHot>
__global__ void __launch_bounds__(kThreads)
    split_race_kernel(const int64_t* __restrict__ parents_all,
                      const int64_t* __restrict__ tokens_all,
                      const float* __restrict__ target_all, const float* __restrict__ draft_all,
                      const float* __restrict__ coins_all, const float* __restrict__ noise_all,
                      int64_t num_nodes, int64_t vocab, int64_t out_len, int64_t splits,
                      SplitPartial* __restrict__ partials, int64_t* __restrict__ row_ints,
                      int64_t* __restrict__ accept_index_all,
                      int64_t* __restrict__ output_tokens_all) {
  __shared__ ArgBest red[kWarps];
  const int64_t b = blockIdx.x;
  const int64_t split = blockIdx.y;
  const int64_t* parents = parents_all + b * num_nodes;
  const int64_t* tokens = tokens_all + b * num_nodes;
  const float* target = target_all + b * num_nodes * vocab;
  const float* draft = kOneHot ? nullptr : draft_all + b * num_nodes * vocab;
  const float* coins = coins_all + b * num_nodes;
  const float* noise = noise_all + b * vocab;
  int64_t* accept_index = accept_index_all + b * out_len;
  int64_t* output_tokens = output_tokens_all + b * out_len;
  const bool writer = split == 0;
  if (writer) reset_outputs(accept_index, output_tokens, out_len);

  const int64_t max_depth = out_len - 1;
  int64_t cur = 0, depth = 0, rejected_child = -1;
  bool branch = false;
  while (depth < max_depth) {
    int64_t child = -1;
    for (int64_t c = cur + 1; c < num_nodes; ++c) {
      if (!is_child(parents, tokens, c, cur, vocab)) continue;
      if (child >= 0) {
        branch = true;
        break;
      }
      child = c;
    }
    if (branch || child < 0) break;
    const int64_t x = tokens[child];
    const float rx = target[cur * vocab + x];
    const bool accept = kOneHot ? tlt_accept_one_hot(coins[child], 1.0, rx)
                                : tlt_accept_general(coins[child], draft[child * vocab + x], 1.0, rx);
    if (!accept) {
      rejected_child = child;
      break;
    }
    if (writer && threadIdx.x == 0) {
      output_tokens[depth] = x;
      accept_index[depth + 1] = child;
    }
    ++depth;
    cur = child;
  }
  if (writer && threadIdx.x == 0) {
    int64_t* ri = row_ints + b * kRowInts;
    ri[0] = depth;
    ri[1] = branch ? 1 : 0;
    ri[2] = cur;
    ri[3] = rejected_child;
  }
  if (branch) return;  // uniform across the row's blocks: split_finish_kernel walks it

  const float* r = target + cur * vocab;
  const float* q = (kOneHot || rejected_child < 0) ? nullptr : draft + rejected_child * vocab;
  const int64_t excluded = (kOneHot && rejected_child >= 0) ? tokens[rejected_child] : -1;
  const bool residual = rejected_child >= 0;
  const int64_t lo = split * kSplitChunk;
  const int64_t hi = lo + kSplitChunk < vocab ? lo + kSplitChunk : vocab;
  float rs = neg_inf(), ps = neg_inf();
  long long ri = INT64_MAX, pi = INT64_MAX;
  for (int64_t v = lo + threadIdx.x; v < hi; v += kThreads) {
    const float rv = r[v];
    const float e = noise[v];
    const float ps_v = tlt_race_score(rv, e);
    if (tlt_better(ps_v, v, ps, pi)) {
      ps = ps_v;
      pi = v;
    }
    float p = rv;
    if (residual) p = kOneHot ? (v == excluded ? 0.0f : rv) : tlt_residual_update(rv, 1.0, q[v]);
    const float rs_v = tlt_race_score(p, e);
    if (tlt_better(rs_v, v, rs, ri)) {
      rs = rs_v;
      ri = v;
    }
  }
  const ArgBest res = block_argbest(rs, ri, red);
  const ArgBest plain = block_argbest(ps, pi, red);
  if (threadIdx.x == 0) partials[b * splits + split] = SplitPartial{res, plain};
}

template <bool kOneHot>
__global__ void __launch_bounds__(kThreads)
    split_finish_kernel(const int64_t* __restrict__ parents_all,
                        const int64_t* __restrict__ tokens_all,
                        const float* __restrict__ target_all, const float* __restrict__ draft_all,
                        const float* __restrict__ coins_all, const float* __restrict__ noise_all,
                        float* work_all, int64_t num_nodes, int64_t vocab, int64_t out_len,
                        int64_t splits, const SplitPartial* __restrict__ partials,
                        const int64_t* __restrict__ row_ints,
                        int64_t* __restrict__ accept_index_all,
                        int64_t* __restrict__ accept_length,
                        int64_t* __restrict__ output_tokens_all) {
  __shared__ ArgBest red[kWarps];
  const int64_t b = blockIdx.x;
  const int64_t* ri = row_ints + b * kRowInts;
  if (ri[1] != 0) {
    rejection_row<kOneHot>(b, parents_all, tokens_all, target_all, draft_all, coins_all,
                           noise_all, work_all, num_nodes, vocab, out_len, accept_index_all,
                           accept_length, output_tokens_all);
    return;
  }
  float rs = neg_inf(), ps = neg_inf();
  long long rix = INT64_MAX, pix = INT64_MAX;
  for (int64_t k = threadIdx.x; k < splits; k += kThreads) {
    const SplitPartial sp = partials[b * splits + k];
    if (tlt_better(sp.residual.score, sp.residual.index, rs, rix)) {
      rs = sp.residual.score;
      rix = sp.residual.index;
    }
    if (tlt_better(sp.plain.score, sp.plain.index, ps, pix)) {
      ps = sp.plain.score;
      pix = sp.plain.index;
    }
  }
  ArgBest w = block_argbest(rs, rix, red);
  const ArgBest plain = block_argbest(ps, pix, red);
  if (w.score < 0.0f) w = plain;
  if (threadIdx.x == 0) {
    const int64_t depth = ri[0];
    output_tokens_all[b * out_len + depth] = w.score < 0.0f ? 0 : w.index;
    accept_length[b] = depth;
  }
}

int64_t split_count(int64_t vocab) { return (vocab + kSplitChunk - 1) / kSplitChunk; }

bool launchable(int64_t batch, int64_t num_nodes, int64_t vocab, int64_t out_len) {
  return batch <= INT32_MAX && num_nodes >= 1 && vocab >= 1 && out_len >= 1;
}

}  // namespace
}  // namespace megatron_tlt

extern "C" int64_t megatron_tlt_cuda_max_nodes(void) { return megatron_tlt::kMaxNodes; }

extern "C" int64_t megatron_tlt_verify_rejection_split_bytes(int64_t batch, int64_t vocab) {
  using namespace megatron_tlt;
  const int64_t splits = split_count(vocab);
  if (splits > kMaxSplits || batch > INT32_MAX) return 0;
  return batch * (splits * static_cast<int64_t>(sizeof(SplitPartial)) +
                  kRowInts * static_cast<int64_t>(sizeof(int64_t)));
}

extern "C" int megatron_tlt_launch_verify_greedy(const int64_t* parents,
                                                 const int64_t* draft_tokens,
                                                 const float* target_probs, int64_t batch,
                                                 int64_t num_nodes, int64_t vocab,
                                                 int64_t out_len, int64_t* accept_index,
                                                 int64_t* accept_length,
                                                 int64_t* output_tokens, void* stream) {
  using namespace megatron_tlt;
  if (batch == 0) return static_cast<int>(cudaSuccess);
  if (!launchable(batch, num_nodes, vocab, out_len)) return static_cast<int>(cudaErrorInvalidValue);
  verify_greedy_kernel<<<static_cast<unsigned>(batch), kThreads, 0,
                         static_cast<cudaStream_t>(stream)>>>(
      parents, draft_tokens, target_probs, num_nodes, vocab, out_len, accept_index,
      accept_length, output_tokens);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int megatron_tlt_launch_verify_rejection(
    const int64_t* parents, const int64_t* draft_tokens, const float* target_probs,
    const float* draft_probs, const float* coins, const float* exp_noise,
    float* residual_workspace, void* split_workspace, int64_t batch, int64_t num_nodes,
    int64_t vocab, int64_t out_len, int64_t* accept_index, int64_t* accept_length,
    int64_t* output_tokens, void* stream) {
  using namespace megatron_tlt;
  if (batch == 0) return static_cast<int>(cudaSuccess);
  if (!launchable(batch, num_nodes, vocab, out_len)) return static_cast<int>(cudaErrorInvalidValue);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (draft_probs == nullptr && num_nodes > kMaxNodes) return static_cast<int>(cudaErrorInvalidValue);
  if (draft_probs != nullptr && residual_workspace == nullptr) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (split_workspace != nullptr) {
    const int64_t splits = split_count(vocab);
    if (splits > kMaxSplits) return static_cast<int>(cudaErrorInvalidValue);
    auto* partials = static_cast<SplitPartial*>(split_workspace);
    auto* row_ints = reinterpret_cast<int64_t*>(partials + batch * splits);
    const dim3 grid(static_cast<unsigned>(batch), static_cast<unsigned>(splits));
    if (draft_probs == nullptr) {
      split_race_kernel<true><<<grid, kThreads, 0, s>>>(
          parents, draft_tokens, target_probs, nullptr, coins, exp_noise, num_nodes, vocab,
          out_len, splits, partials, row_ints, accept_index, output_tokens);
      split_finish_kernel<true><<<static_cast<unsigned>(batch), kThreads, 0, s>>>(
          parents, draft_tokens, target_probs, nullptr, coins, exp_noise, nullptr, num_nodes,
          vocab, out_len, splits, partials, row_ints, accept_index, accept_length, output_tokens);
    } else {
      split_race_kernel<false><<<grid, kThreads, 0, s>>>(
          parents, draft_tokens, target_probs, draft_probs, coins, exp_noise, num_nodes, vocab,
          out_len, splits, partials, row_ints, accept_index, output_tokens);
      split_finish_kernel<false><<<static_cast<unsigned>(batch), kThreads, 0, s>>>(
          parents, draft_tokens, target_probs, draft_probs, coins, exp_noise,
          residual_workspace, num_nodes, vocab, out_len, splits, partials, row_ints,
          accept_index, accept_length, output_tokens);
    }
    return static_cast<int>(cudaGetLastError());
  }
  if (draft_probs == nullptr) {
    if (num_nodes > kMaxNodes) return static_cast<int>(cudaErrorInvalidValue);
    verify_rejection_kernel<true><<<static_cast<unsigned>(batch), kThreads, 0, s>>>(
        parents, draft_tokens, target_probs, nullptr, coins, exp_noise, nullptr, num_nodes,
        vocab, out_len, accept_index, accept_length, output_tokens);
  } else {
    if (residual_workspace == nullptr) return static_cast<int>(cudaErrorInvalidValue);
    verify_rejection_kernel<false><<<static_cast<unsigned>(batch), kThreads, 0, s>>>(
        parents, draft_tokens, target_probs, draft_probs, coins, exp_noise, residual_workspace,
        num_nodes, vocab, out_len, accept_index, accept_length, output_tokens);
  }
  return static_cast<int>(cudaGetLastError());
}
