"""Quantised frozen weights (QLoRA): see fsdp_jax/quant/codes.py and weight.py."""
