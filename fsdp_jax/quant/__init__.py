"""Quantised weights and matmuls: QLoRA's frozen weights (codes.py, weight.py, modules.py) and
FP8 training's scaled matmuls (fp8.py, fp8_modules.py; docs/fp8.md)."""
