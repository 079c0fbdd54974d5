// Speculative-decoding verification: the op schemas (the one TORCH_LIBRARY block of
// megatron_tlt) and their CPU kernels.
//
// Semantics, terms and the exact arithmetic are defined by the PyTorch reference
// megatron_tlt/spec/verify_ref.py; this file follows it step by step, one sequence at a
// time (sequences in parallel with at::parallel_for). Outputs are written in place.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

#include "verify_checks.h"
#include "verify_common.h"

namespace megatron_tlt {
namespace {

struct TreeRow {
  const int64_t* parents;  // [num_nodes]
  const int64_t* tokens;   // [num_nodes]
  int64_t num_nodes;
  int64_t vocab;

  bool is_child(int64_t c, int64_t cur) const {
    return tlt_node_valid(c, parents[c], tokens[c], vocab) && parents[c] == cur;
  }
};

struct OutRow {
  int64_t* accept_index;   // [out_len]
  int64_t* output_tokens;  // [out_len]
  int64_t out_len;

  void reset() const {
    for (int64_t i = 0; i < out_len; ++i) {
      accept_index[i] = -1;
      output_tokens[i] = -1;
    }
    accept_index[0] = 0;
  }
};

bool contains(const std::vector<int64_t>& xs, int64_t x) {
  for (int64_t y : xs) {
    if (y == x) return true;
  }
  return false;
}

// argmax over the vocabulary with tlt_better (NaN never wins, ties -> lowest id).
int64_t greedy_argmax(const float* p, int64_t vocab) {
  float best = tlt_greedy_score(p[0]);
  int64_t best_i = 0;
  for (int64_t v = 1; v < vocab; ++v) {
    const float s = tlt_greedy_score(p[v]);
    if (tlt_better(s, v, best, best_i)) {
      best = s;
      best_i = v;
    }
  }
  return best_i;
}

// Exponential race over residual r (entries of `excluded` count as 0).
// Returns -1 when no token has positive residual mass.
int64_t race(const float* r, const float* noise, int64_t vocab,
             const std::vector<int64_t>* excluded) {
  float best = -1.0f;
  int64_t best_i = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    const float p = (excluded != nullptr && contains(*excluded, v)) ? 0.0f : r[v];
    const float s = tlt_race_score(p, noise[v]);
    if (tlt_better(s, v, best, best_i)) {
      best = s;
      best_i = v;
    }
  }
  return best >= 0.0f ? best_i : -1;
}

void greedy_one(const TreeRow& tree, const float* target, const OutRow& out,
                int64_t* accept_length) {
  out.reset();
  const int64_t vocab = tree.vocab;
  const int64_t max_depth = out.out_len - 1;
  int64_t cur = 0;
  int64_t depth = 0;
  while (true) {
    const int64_t best = greedy_argmax(target + cur * vocab, vocab);
    int64_t next = -1;
    if (depth < max_depth) {
      for (int64_t c = cur + 1; c < tree.num_nodes; ++c) {
        if (tree.is_child(c, cur) && tree.tokens[c] == best) {
          next = c;
          break;
        }
      }
    }
    if (next < 0) {
      out.output_tokens[depth] = best;  // bonus token
      break;
    }
    out.output_tokens[depth] = tree.tokens[next];
    ++depth;
    out.accept_index[depth] = next;
    cur = next;
  }
  *accept_length = depth;
}

// draft_probs == nullptr: one-hot proposals; work: [vocab] scratch for general q.
void rejection_one(const TreeRow& tree, const float* target, const float* draft_probs,
                   const float* coins, const float* noise, float* work, const OutRow& out,
                   int64_t* accept_length) {
  out.reset();
  const int64_t vocab = tree.vocab;
  const int64_t max_depth = out.out_len - 1;
  std::vector<int64_t> rejected;  // one-hot: tokens whose residual entry is zeroed
  int64_t cur = 0;
  int64_t depth = 0;
  while (true) {
    const float* r = target + cur * vocab;  // residual, unnormalised
    double mass = 1.0;                      // its mass
    rejected.clear();
    int64_t next = -1;
    if (depth < max_depth) {
      for (int64_t c = cur + 1; c < tree.num_nodes; ++c) {
        if (!tree.is_child(c, cur)) continue;
        const int64_t x = tree.tokens[c];
        const float u = coins[c];
        if (draft_probs == nullptr) {
          const float rx = contains(rejected, x) ? 0.0f : r[x];
          if (tlt_accept_one_hot(u, mass, rx)) {
            next = c;
            break;
          }
          mass = tlt_sub(mass, static_cast<double>(rx));
          rejected.push_back(x);
        } else {
          const float* q = draft_probs + c * vocab;
          if (tlt_accept_general(u, q[x], mass, r[x])) {
            next = c;
            break;
          }
          uint64_t fixed_sum = 0;
          for (int64_t v = 0; v < vocab; ++v) {
            work[v] = tlt_residual_update(r[v], mass, q[v]);
            fixed_sum += tlt_fixed_from_prob(work[v]);
          }
          r = work;
          mass = tlt_mass_from_fixed(fixed_sum);
        }
      }
    }
    if (next >= 0) {
      out.output_tokens[depth] = tree.tokens[next];
      ++depth;
      out.accept_index[depth] = next;
      cur = next;
      continue;
    }
    // Recovered token (something was rejected here) or bonus token (nothing was).
    int64_t token = race(r, noise, vocab, draft_probs == nullptr ? &rejected : nullptr);
    if (token < 0) token = race(target + cur * vocab, noise, vocab, nullptr);  // degenerate
    if (token < 0) token = 0;  // the target row has no positive entry: invalid input
    out.output_tokens[depth] = token;
    break;
  }
  *accept_length = depth;
}

constexpr const char* kGreedyOp = "megatron_tlt::verify_tree_greedy";
constexpr const char* kRejectionOp = "megatron_tlt::verify_tree_rejection";

void verify_tree_greedy_cpu(const at::Tensor& parents, const at::Tensor& draft_tokens,
                            const at::Tensor& target_probs, const at::Tensor& accept_index,
                            const at::Tensor& accept_length, const at::Tensor& output_tokens) {
  TORCH_CHECK(target_probs.device().is_cpu(), kGreedyOp, ": CPU kernel got ",
              target_probs.device());
  const VerifySizes s =
      check_verify_args(kGreedyOp, parents, draft_tokens, target_probs, std::nullopt, nullptr,
                        nullptr, accept_index, accept_length, output_tokens);
  const int64_t* par = parents.data_ptr<int64_t>();
  const int64_t* tok = draft_tokens.data_ptr<int64_t>();
  const float* tgt = target_probs.data_ptr<float>();
  int64_t* ai = accept_index.data_ptr<int64_t>();
  int64_t* al = accept_length.data_ptr<int64_t>();
  int64_t* ot = output_tokens.data_ptr<int64_t>();
  at::parallel_for(0, s.batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const TreeRow tree{par + b * s.num_nodes, tok + b * s.num_nodes, s.num_nodes, s.vocab};
      const OutRow out{ai + b * s.out_len, ot + b * s.out_len, s.out_len};
      greedy_one(tree, tgt + b * s.num_nodes * s.vocab, out, al + b);
    }
  });
}

void verify_tree_rejection_cpu(const at::Tensor& parents, const at::Tensor& draft_tokens,
                               const at::Tensor& target_probs,
                               const std::optional<at::Tensor>& draft_probs,
                               const at::Tensor& coins, const at::Tensor& exp_noise,
                               const at::Tensor& accept_index, const at::Tensor& accept_length,
                               const at::Tensor& output_tokens) {
  TORCH_CHECK(target_probs.device().is_cpu(), kRejectionOp, ": CPU kernel got ",
              target_probs.device());
  const VerifySizes s =
      check_verify_args(kRejectionOp, parents, draft_tokens, target_probs, draft_probs, &coins,
                        &exp_noise, accept_index, accept_length, output_tokens);
  const bool general = draft_probs.has_value() && draft_probs->defined();
  const int64_t* par = parents.data_ptr<int64_t>();
  const int64_t* tok = draft_tokens.data_ptr<int64_t>();
  const float* tgt = target_probs.data_ptr<float>();
  const float* dft = general ? draft_probs->data_ptr<float>() : nullptr;
  const float* cns = coins.data_ptr<float>();
  const float* noi = exp_noise.data_ptr<float>();
  int64_t* ai = accept_index.data_ptr<int64_t>();
  int64_t* al = accept_length.data_ptr<int64_t>();
  int64_t* ot = output_tokens.data_ptr<int64_t>();
  const int64_t row = s.num_nodes * s.vocab;
  at::parallel_for(0, s.batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work(general ? s.vocab : 0);
    for (int64_t b = begin; b < end; ++b) {
      const TreeRow tree{par + b * s.num_nodes, tok + b * s.num_nodes, s.num_nodes, s.vocab};
      const OutRow out{ai + b * s.out_len, ot + b * s.out_len, s.out_len};
      rejection_one(tree, tgt + b * row, general ? dft + b * row : nullptr,
                    cns + b * s.num_nodes, noi + b * s.vocab, work.data(), out, al + b);
    }
  });
}

}  // namespace
}  // namespace megatron_tlt

// The one schema definition of the megatron_tlt op namespace. Outputs are mutated in
// place (Tensor(a!)) and the ops return nothing, so they capture in CUDA graphs and
// functionalise under torch.compile (fake impls: megatron_tlt/spec/_ops.py).
TORCH_LIBRARY(megatron_tlt, m) {
  m.def(
      "verify_tree_greedy(Tensor parents, Tensor draft_tokens, Tensor target_probs, "
      "Tensor(a!) accept_index, Tensor(b!) accept_length, Tensor(c!) output_tokens) -> ()");
  m.def(
      "verify_tree_rejection(Tensor parents, Tensor draft_tokens, Tensor target_probs, "
      "Tensor? draft_probs, Tensor coins, Tensor exp_noise, Tensor(a!) accept_index, "
      "Tensor(b!) accept_length, Tensor(c!) output_tokens) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_tlt, CPU, m) {
  m.impl("verify_tree_greedy", &megatron_tlt::verify_tree_greedy_cpu);
  m.impl("verify_tree_rejection", &megatron_tlt::verify_tree_rejection_cpu);
}
