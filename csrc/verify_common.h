// Scalar rules shared by the CPU and CUDA verification kernels.
//
// Plain C++ (no torch, no CUDA runtime), so both verify_cpu.cpp and verify_cuda.cu
// include it and the two backends cannot drift. Every function here has a line-by-line
// twin in megatron_tlt/spec/verify_ref.py (the spec); keep them in step.
//
// Bit-exact agreement between CPU, CUDA and the PyTorch reference rests on three rules:
//  1. Every floating-point operation is a single IEEE operation rounded to nearest:
//     no fused multiply-add (device code uses __dmul_rn/__dsub_rn explicitly, the CPU
//     build passes -ffp-contract=off, the .cu is built with --fmad=false), no fast math.
//  2. The only reduction over the vocabulary with a floating result (the mass of a
//     general-q residual) is computed exactly, in fixed point (tlt_fixed_from_prob),
//     so its order does not matter.
//  3. Argmax-style reductions use a total order on (score, index) (tlt_better), so any
//     reduction tree picks the same winner: the largest score, ties to the lowest index.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define TLT_HD __host__ __device__ __forceinline__
#else
#define TLT_HD inline
#endif

namespace megatron_tlt {

// Fixed-point scale of residual masses: a probability x in [0, 1] becomes
// trunc(x * 2^58). Sums of up to 32 such terms-worth of mass fit in int64; a valid
// residual (a sub-distribution) sums to at most ~1. Truncation loses < 2^-58 per entry.
constexpr double kFixedScale = 288230376151711744.0;      // 2^58
constexpr double kFixedInvScale = 3.469446951953614e-18;  // 2^-58 (exact)

TLT_HD double tlt_mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

TLT_HD double tlt_sub(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}

// A draft node takes part in verification iff it is not the root, its parent is an
// earlier node and its token is in the vocabulary. Anything else is padding (ignored,
// as are the nodes below it, which can never be reached).
TLT_HD bool tlt_node_valid(int64_t node, int64_t parent, int64_t token, int64_t vocab) {
  return node > 0 && parent >= 0 && parent < node && token >= 0 && token < vocab;
}

// Exponential-race score of token v: p(v) / E(v) for p(v) > 0, else -1 (never wins
// against a real candidate). A NaN or negative quotient (bad noise) is also -1.
TLT_HD float tlt_race_score(float p, float e) {
  if (!(p > 0.0f)) return -1.0f;
  const float s = p / e;
  return s >= 0.0f ? s : -1.0f;
}

// Greedy score: the value itself, NaN treated as -inf (NaN never wins).
TLT_HD float tlt_greedy_score(float x) { return x != x ? -__builtin_huge_valf() : x; }

// Total order used by every argmax: higher score first, then lower index.
TLT_HD bool tlt_better(float s1, int64_t i1, float s2, int64_t i2) {
  return s1 > s2 || (s1 == s2 && i1 < i2);
}

// Fixed-point image of a residual entry (x >= 0 and not NaN by construction; values
// above 1 are clamped to 1).
TLT_HD uint64_t tlt_fixed_from_prob(float x) {
  const float c = x < 1.0f ? x : 1.0f;
  return static_cast<uint64_t>(tlt_mul(static_cast<double>(c), kFixedScale));
}

// Mass from a fixed-point sum. The sum is accumulated modulo 2^64 and read as a
// two's-complement int64, which is what the reference's int64 sum does as well.
TLT_HD double tlt_mass_from_fixed(uint64_t sum) {
  return tlt_mul(static_cast<double>(static_cast<int64_t>(sum)), kFixedInvScale);
}

// One entry of the general-q residual after rejecting a draft drawn from q:
// max(r - m * q, 0) in float64, stored as float32 (r is the unnormalised residual
// with mass m, so r / m - q is the normalised difference, times m).
TLT_HD float tlt_residual_update(float r, double mass, float q) {
  const double t = tlt_sub(static_cast<double>(r), tlt_mul(mass, static_cast<double>(q)));
  return t > 0.0 ? static_cast<float>(t) : 0.0f;
}

// Acceptance tests. One-hot proposal: u < r(x) / m. General proposal q:
// u < (r(x) / m) / q(x). Written without division so they are exact comparisons.
TLT_HD bool tlt_accept_one_hot(float u, double mass, float rx) {
  return tlt_mul(static_cast<double>(u), mass) < static_cast<double>(rx);
}

TLT_HD bool tlt_accept_general(float u, float qx, double mass, float rx) {
  return tlt_mul(tlt_mul(static_cast<double>(u), static_cast<double>(qx)), mass) <
         static_cast<double>(rx);
}

}  // namespace megatron_tlt

// ---- CUDA launchers (defined in verify_cuda.cu; plain pointers, no torch) ---------
// Return the cudaError_t of the launch as an int (0 = success) so this header does not
// need cuda_runtime.h. `stream` is a cudaStream_t.
extern "C" {
int megatron_tlt_launch_verify_greedy(const int64_t* parents, const int64_t* draft_tokens,
                                      const float* target_probs, int64_t batch,
                                      int64_t num_nodes, int64_t vocab, int64_t out_len,
                                      int64_t* accept_index, int64_t* accept_length,
                                      int64_t* output_tokens, void* stream);

// draft_probs == nullptr: one-hot proposals. residual_workspace: [batch, vocab] float32,
// required when draft_probs != nullptr (its contents are scratch). split_workspace:
// megatron_tlt_verify_rejection_split_bytes(batch, vocab) bytes of scratch (8-byte
// aligned) for the split path (chains raced over many blocks per row; same outputs), or
// nullptr for one block per row.
int megatron_tlt_launch_verify_rejection(
    const int64_t* parents, const int64_t* draft_tokens, const float* target_probs,
    const float* draft_probs, const float* coins, const float* exp_noise,
    float* residual_workspace, void* split_workspace, int64_t batch, int64_t num_nodes,
    int64_t vocab, int64_t out_len, int64_t* accept_index, int64_t* accept_length,
    int64_t* output_tokens, void* stream);

// Scratch bytes of the split path for (batch, vocab); 0 when the split path cannot run
// (vocabulary too large for its split count).
int64_t megatron_tlt_verify_rejection_split_bytes(int64_t batch, int64_t vocab);

// Largest num_nodes the CUDA rejection kernel accepts (its rejected-token list lives in
// shared memory).
int64_t megatron_tlt_cuda_max_nodes(void);
}
