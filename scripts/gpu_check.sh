#!/usr/bin/env bash
# One prepared GPU run (~5 minutes on one H100/H200-class GPU, issue 63); installs nothing
# outside /tmp.
#   bash scripts/gpu_check.sh [LOG_DIR]              # on the GPU machine
#   GPU_CHECK_SMOKE=1 bash scripts/gpu_check.sh DIR  # CPU rehearsal: XLA twins, tiny shapes
# Each group of checks runs in its own process under its own time cap (`timeout`), inside a
# whole-script budget (GPU_CHECK_BUDGET_S, default 320 s): a crash or a hang costs one group.
#  1. throughput of configs/llama_1b.yaml (bf16, cuDNN attention) with remat dots, then full:
#     step time, tokens/s, MFU, the device's peak_bytes_in_use and the compiled peak;
#  2. the GPU-only paths against XLA on the same batch (fsdp_jax.app.cli.gpu_paths):
#     cudnn_packed, lora, precision, collectives | ring_cudnn | tokamax_moe | offload;
#  3. throughput (dots) again with fsdp_jax.targets.xla_flags.GPU_FSDP_FLAGS, if time is left.
# tokamax (absent on the device machine) comes from wheels in .whl/ (pass `carry: [.whl]`),
# installed into /tmp for the tokamax process only; a stub in /tmp stands in for xprof.
# LOG_DIR (default $OUT or gpu_logs/) gets 4 files: env.txt, log.txt, results.json, summary.md.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-${OUT:-gpu_logs}}
SMOKE=${GPU_CHECK_SMOKE:-0}
BUDGET=${GPU_CHECK_BUDGET_S:-320}
SCALE=${GPU_CHECK_CAP_SCALE:-1}  # caps x SCALE (a loaded CPU rehearsal compiles 10x slower)
PY=${PYTHON:-python3}
mkdir -p "$LOG"
TMP=$(mktemp -d)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SMOKE_ARG=()
[ "$SMOKE" = 1 ] && SMOKE_ARG=(--smoke)
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  $PY -c "import sys, jax, jaxlib, flax, optax; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__); print(jax.devices())" 2>&1
  git log -1 --format='commit %H %s' 2>/dev/null
} > "$LOG/env.txt"

# tokamax and the packages it imports, for its process only
TOKAMAX_PATH=$PYTHONPATH
if [ "$SMOKE" != 1 ] && [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site .whl/*.whl \
    >> "$LOG/env.txt" 2>&1; then
    TOKAMAX_PATH="$PYTHONPATH:/tmp/gpu_check_site"
    if ! PYTHONPATH=$TOKAMAX_PATH $PY -c "import xprof" 2> /dev/null; then
      # tokamax imports xprof's get_kernel_stats_tool at module level, for its xprof timing only
      mkdir -p /tmp/gpu_check_stub/xprof/cli
      touch /tmp/gpu_check_stub/xprof/__init__.py /tmp/gpu_check_stub/xprof/cli/__init__.py
      printf 'def get_kernel_stats_tool(*a, **k):\n    raise RuntimeError("xprof stand-in (gpu_check.sh)")\n' \
        > /tmp/gpu_check_stub/xprof/cli/tools.py
      TOKAMAX_PATH="$TOKAMAX_PATH:/tmp/gpu_check_stub"
    fi
  fi
fi

start=$SECONDS
# group LABEL CAP_S [PYTHONPATH=...] -- ARGS...: one process, its own cap, inside the budget
group() {
  local label=$1 cap=$(($2 * SCALE)) path=$PYTHONPATH
  shift 2
  [ "${1:-}" = "--path" ] && path=$2 && shift 2
  local left=$((BUDGET - (SECONDS - start)))
  if ((left < 25 * SCALE)); then
    echo "{\"skipped\": \"the script's ${BUDGET} s budget was spent\"}" > "$TMP/$label.skip"
    return
  fi
  ((cap > left)) && cap=$left
  echo "======== $label (cap ${cap} s): $*" >> "$LOG/log.txt"
  local t0=$SECONDS
  PYTHONPATH=$path timeout -k 10 "$cap" $PY scripts/gpu_check.py --json "$TMP/$label.json" "${SMOKE_ARG[@]}" "$@" \
    >> "$LOG/log.txt" 2>&1
  local rc=$?
  echo "$label $rc $((SECONDS - t0)) $cap" >> "$TMP/rcs"
  echo "== $label: exit $rc after $((SECONDS - t0)) s (cap $cap s)"
}

group throughput_dots 100 --only throughput remat=dots
group throughput_full 80 --only throughput remat=full
group paths 80 --only cudnn_packed,lora,precision,collectives
group ring 45 --only ring_cudnn
group tokamax 60 --path "$TOKAMAX_PATH" --only tokamax_moe
group offload 80 --only offload
FLAGS=$($PY -c "from fsdp_jax.targets.xla_flags import GPU_FSDP_FLAGS; print(' '.join(GPU_FSDP_FLAGS))" 2> /dev/null)
export XLA_FLAGS="${XLA_FLAGS:-} $FLAGS"
group throughput_dots_fsdp_flags 70 --only throughput remat=dots

$PY - "$TMP" "$LOG" "$FLAGS" << 'EOF'
import json, sys
from pathlib import Path

tmp, log, flags = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
res = {"fsdp_flags": flags, "groups": {}}
for line in (tmp / "rcs").read_text().splitlines() if (tmp / "rcs").exists() else []:
    label, rc, wall, cap = line.split()
    res["groups"][label] = {"rc": int(rc), "wall_s": int(wall), "cap_s": int(cap), "timed_out": rc in ("124", "137")}
for p in sorted(tmp.iterdir()):
    if p.suffix in (".json", ".skip"):
        res.setdefault(p.stem, {}).update(json.loads(p.read_text()))
(log / "results.json").write_text(json.dumps(res, indent=1, default=str))

from fsdp_jax.app.cli.gpu_check import verdict

rows = ["| group / check | result |", "|---|---|"]
for label, g in res["groups"].items():
    rows.append(f"| {label} | exit {g['rc']}{' (TIMED OUT)' if g['timed_out'] else ''}, {g['wall_s']} s |")
for label, checks in res.items():
    if not isinstance(checks, dict) or label in ("groups",):
        continue
    if "skipped" in checks:
        rows.append(f"| {label} | skipped: {checks['skipped']} |")
        continue
    for name, r in checks.items():
        if name == "throughput" and "tokens_per_s" in r:
            peak = r.get("peak_bytes_in_use") or 0
            cp = r["compiled"]["peak"]
            rows.append(
                f"| {label} ({r['params'] / 1e9:.2f}B, {r['global_batch']}x{r['seq_len']}, {r['remat']}, "
                f"{r['attention']}) | step {r['step_s_median'] * 1e3:.1f} ms, {r['tokens_per_s']:,.0f} tok/s, "
                f"MFU {r['mfu'] or 0:.1%}, peak_bytes_in_use {peak / 1e9:.2f} GB vs compiled {cp / 1e9:.2f} GB "
                f"({peak / cp - 1:+.1%}), compile {r['compile_s']:.0f} s |"
            )
        elif name == "offload" and "runs" in r:
            cells = [
                f"{k}: {v['step_s_median'] * 1e3:.0f} ms (transfers {v.get('transfer_share', 0):.0%})"
                if "step_s_median" in v
                else f"{k}: {v.get('error', '?')[:120]}"
                for k, v in r["runs"].items()
            ]
            rows.append(f"| {label}: offload | {'; '.join(cells)} |")
        elif isinstance(r, dict):
            rows.append(f"| {label}: {name} | {verdict(r)} |")
(log / "summary.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
EOF
echo "== env"
cat "$LOG/env.txt" | head -6
rm -rf "$TMP"
