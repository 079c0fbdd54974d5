"""Megatron-Core actor: process groups, TransformerConfig and GPTModel from a ModelArch.

Layer spec: TransformerEngine's when `transformer_engine` imports (GPU clusters), the
Megatron-Core local spec otherwise (CPU, CI, machines without TE). The two specs name
the fused input norms differently; `models/hf_mapping.py` handles both.

On a CPU, `megatron_tlt.compat.apply()` must run first (`init_parallel` does it).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_tlt import compat
from megatron_tlt.errors import ConfigError
from megatron_tlt.models.arch import ModelArch

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: Optional[str] = None) -> None:
    """torch.distributed from torchrun's env, or a single local process without it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(minutes=10)
    if "RANK" not in os.environ:
        # A plain `python`/`megatron-tlt` run: a world of one on a free local port. The
        # address goes in init_method, not os.environ, so child processes (conversion,
        # tests launching runs) do not inherit a RANK/MASTER_PORT that is not theirs.
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)


_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE")


def single_process_env() -> dict[str, str]:
    """os.environ without what torchrun told this process (its rank, world, rendezvous and
    the elastic agent's store variables): the environment of a child that must be a world
    of one (conversion, export) rather than join, or wait for, this job's world."""
    return {k: v for k, v in os.environ.items()
            if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}


def init_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, backend: Optional[str] = None) -> None:
    """Initialise torch.distributed and Megatron's process groups (TP x PP x DP).

    DP is what remains: world_size / (tp * pp). Raises ConfigError naming the sizes when
    they do not divide the world.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    compat.apply()
    init_distributed(backend)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ConfigError(
            f"world size ({world}) must be a multiple of tensor_model_parallel_size ({tp}) x "
            f"pipeline_model_parallel_size ({pp})")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 create_gloo_process_groups=True)
    compat.model_parallel_seed(seed)


def destroy_parallel() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def transformer_config(arch: ModelArch, *, tp: int = 1, pp: int = 1, dtype: str = "float32",
                       init_method_std: float = 0.02, perform_initialization: bool = True,
                       sequence_parallel: bool = False, recompute: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch.check_parallel(tp, pp)
    on_gpu = torch.cuda.is_available()
    if sequence_parallel and not (on_gpu and have_te()):
        raise ConfigError("sequence_parallel=true needs TransformerEngine (or apex) norms on a GPU")
    dt = torch_dtype(dtype)
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=init_method_std,
        perform_initialization=perform_initialization,
        use_cpu_initialization=not on_gpu,
        params_dtype=dt,
        bf16=dt is torch.bfloat16,
        fp16=dt is torch.float16,
        pipeline_dtype=dt,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        # Fusions that need CUDA (or apex) are off on CPU; on GPU TE provides its own.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        batch_p2p_sync=False,  # True calls torch.cuda.synchronize()
        recompute_granularity="selective" if recompute else None,
        attention_softmax_in_fp32=True,
    )


def layer_spec(arch: ModelArch, use_te: Optional[bool] = None):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te is None:
        use_te = torch.cuda.is_available() and have_te()
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    spec = specs.get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    from megatron_tlt.models.sdpa_attention import SDPADotProductAttention, sdpa_enabled
    if sdpa_enabled():  # MEGATRON_TLT_SDPA_ATTENTION=1: one SDPA call instead of the unfused scores
        spec.submodules.self_attention.submodules.core_attention = SDPADotProductAttention
    return spec


def build_gpt_model(arch: ModelArch, config, *, use_te: Optional[bool] = None,
                    pre_process: Optional[bool] = None, post_process: Optional[bool] = None):
    """The policy as a Megatron-Core GPTModel, this rank's pipeline stage of it."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage()
    if post_process is None:
        post_process = ps.is_pipeline_last_stage()
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(arch, use_te),
        vocab_size=arch.padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        rotary_percent=1.0,
    )
    for m in model.modules():
        if type(m) is torch.nn.RMSNorm:
            m.__class__ = MixedRMSNorm  # the local spec's norms (no state added)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


class MixedRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm for the local layer spec's norms, whose weights Megatron-Core builds
    in float32 whatever params_dtype is (WrappedTorchNorm passes no dtype), under bf16
    activations. torch's rms_norm with a weight of another dtype warns and takes its
    composite form (about seven kernels forward, more backward, over float32
    intermediates); this runs the same math - float32 throughout, rounded once to the
    input's dtype - as one fused call on the input cast to the weight's dtype. Same bits
    on CPU (tests/unit/models/test_mixed_rms_norm.py); the weights, the state dict and
    the checkpoints are unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w is not None and x.dtype != w.dtype:
            return F.rms_norm(x.to(w.dtype), self.normalized_shape, w, self.eps).to(x.dtype)
        return super().forward(x)


def gather_logits(logits: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """Vocab-parallel logits [b, s, V_pad/tp] -> full unpadded logits [b, s, V]."""
    from megatron.core import tensor_parallel

    full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return full[..., : arch.vocab_size]


def causal_position_ids(batch: int, seq: int, device=None) -> torch.Tensor:
    return torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
