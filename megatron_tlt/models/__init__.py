"""Model description, Megatron-Core builder, and HF <-> Megatron mapping."""
