#!/usr/bin/env bash
# One prepared GPU run (< 8 minutes on one H100/H200-class GPU); installs nothing.
#   bash scripts/gpu_check.sh [LOG_DIR]
# 1. all checks with default XLA flags (throughput of configs/llama_1b.yaml in bf16 with
#    cuDNN attention and dots remat, bf16-vs-fp32 precision, collective dtypes);
# 2. throughput again with the FSDP-oriented XLA GPU flags (fsdp_jax.targets.xla_flags.GPU_FSDP_FLAGS),
#    so a flag becomes a default only after it is measured.
# Full logs and JSON go to LOG_DIR (default $OUT or gpu_logs/); a short table prints last.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-${OUT:-gpu_logs}}
mkdir -p "$LOG"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$LOG/nvidia-smi.txt" 2>&1
python -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__)" \
  > "$LOG/versions.txt" 2>&1

timeout 300 python scripts/gpu_check.py --json "$LOG/default.json" > "$LOG/default.log" 2>&1
rc1=$?
FLAGS=$(python -c "from fsdp_jax.targets.xla_flags import GPU_FSDP_FLAGS; print(' '.join(GPU_FSDP_FLAGS))")
XLA_FLAGS="${XLA_FLAGS:-} $FLAGS" timeout 180 python scripts/gpu_check.py --only throughput \
  --json "$LOG/flags.json" > "$LOG/flags.log" 2>&1
rc2=$?

echo "== versions"; cat "$LOG/versions.txt" "$LOG/nvidia-smi.txt"
echo "== default XLA flags (exit $rc1)"; sed -n '/^| check/,$p' "$LOG/default.log"
echo "== with: $FLAGS (exit $rc2)"; sed -n '/^| check/,$p' "$LOG/flags.log" | grep throughput
exit $(( rc1 != 0 ))
