"""Speculative decoding: drafters, draft trees, verification, strategies.

Verification (lossless by default): `megatron_tlt.spec.verify` (entry points wrapping the
csrc/ kernels), `verify_ref` (the PyTorch reference, which defines the semantics and the
terms), `sampling_ref` (logit processing shared by target and drafter).
Nothing is imported here so that importing a submodule stays cheap.
"""
