#!/usr/bin/env bash
# GPU check of the InfLLM v2 Pallas kernels (issue 4, "On a GPU"): one prepared run, under 5 minutes.
#
#   bash scripts/gpu_check.sh              # on the NVIDIA machine: its python3, PYTHONPATH=., installs nothing
#   bash scripts/gpu_check.sh --quick      # fewer correctness cases / iterations, backward only up to 32K
#   bash scripts/gpu_check.sh --tune       # then also the kernel-parameter sweep (--part tune, <= 210 s more)
#   bash scripts/gpu_check.sh --dry-run    # CPU, interpret=True, tiny sizes: checks this script, not the kernels
#   bash scripts/gpu_check.sh --out DIR    # results directory (default: $OUT if set, else runs/gpu_check;
#                                          # dry run: .cache/gpu_check_dry_run)
#   bash scripts/gpu_check.sh -- ARGS      # ARGS go to every scripts/gpu_kernel_check.py part
#                                          # (e.g. -- --lengths 8192 32768 --decode-batch 4)
#
# Steps, each its own process under `timeout` (a hang or crash costs that step only; every part rewrites its
# JSON after each case, so a killed step keeps what it measured):
#   env          device / versions, and that the model and ops/ import without grain and tensorboardX
#   correctness  Pallas kernels compiled for the GPU (backend="triton", interpret=False) vs the XLA references,
#                fp32 (<= 1e-5 forward, <= 1e-4 relative gradients) and bf16 (<= 2e-2)
#   decode       sparse decode (Pallas stage 1 + sparse flash-decoding) vs dense (cuDNN/XLA, Pallas) at 8K/32K/128K,
#                batch 1; 128K also at batch 16 (--decode-big-batch)
#   prefill      stage-2 kernel (+ selection) vs dense jax.nn.dot_product_attention (cuDNN) at 8K/32K/128K
#   prefill-bwd  the same, forward + backward (only with the budget left)
#   tune         (--tune only) dense attention forward + backward at 8K (cuDNN, the XLA reference, the blockwise
#                XLA path of attention_impl auto at several block sizes), stage-2 / stage-1 kernel parameters swept
#                at 32K, the selection tile and stage-2 tokens per tile at 128K; reported, not part of the verdict
#   summary      summary.txt / summary.json from the part files
# Output: DIR/{env,correctness,decode,prefill,prefill-bwd,summary}.log, DIR/*.json, DIR/steps.tsv,
# DIR/summary.{txt,json}. Exit status 0 iff every step and every check passed.
#
# Environment: PYTHON (default python3; the dry run prefers .venv/bin/python), GPU_CHECK_BUDGET_S (total
# seconds for the steps before the summary, default 295; --tune adds its own), GPU_CHECK_TIMEOUT_<STEP> (per-step seconds, e.g.
# GPU_CHECK_TIMEOUT_PREFILL=90), GPU_CHECK_JAX_CACHE (persistent compilation cache, default
# /tmp/gpu_check_jax_cache: a rerun on the same machine skips most compilation).
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DRY=0
QUICK=0
TUNE=0
EXTRA=()  # arguments after "--" go to every gpu_kernel_check.py part (e.g. -- --lengths 8192 32768)
OUTDIR="${OUT:-}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --quick) QUICK=1 ;;
    --tune) TUNE=1 ;;
    --out) OUTDIR="$2"; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (use --dry-run, --quick, --tune, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
if [[ -z "$OUTDIR" ]]; then
  if ((DRY)); then OUTDIR=.cache/gpu_check_dry_run; else OUTDIR=runs/gpu_check; fi
fi
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
rm -f "$OUTDIR"/steps.tsv "$OUTDIR"/{env,correctness,decode,prefill,prefill_bwd,tune,summary}.json "$OUTDIR"/summary.txt

if [[ -z "${PYTHON:-}" ]]; then
  if ((DRY)) && [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export GPU_CHECK_JAX_CACHE="${GPU_CHECK_JAX_CACHE:-/tmp/gpu_check_jax_cache}"
export PYTHONUNBUFFERED=1
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-1}"

COMMON=(--out "$OUTDIR")
if ((DRY)); then
  COMMON+=(--cpu-dry-run)
  BUDGET="${GPU_CHECK_BUDGET_S:-600}"
  declare -A TMO=([env]=60 [correctness]=240 [decode]=120 [prefill]=120 [prefill-bwd]=120 [tune]=120)
else
  # a cold start compiled one fp32 correctness case for 64 s (H200, 2026-11-29): correctness gets the most time
  BUDGET="${GPU_CHECK_BUDGET_S:-295}"
  declare -A TMO=([env]=20 [correctness]=150 [decode]=95 [prefill]=70 [prefill-bwd]=50 [tune]=210)
fi
((QUICK)) && COMMON+=(--quick)
RESERVE=5    # seconds kept for the summary
((TUNE)) && BUDGET=$((BUDGET + ${GPU_CHECK_TIMEOUT_TUNE:-${TMO[tune]}}))  # the sweep's time comes on top
MIN_STEP=15  # a step with less time than this left is skipped

echo "gpu_check: $(date -u +%FT%TZ) out=$OUTDIR python=$PYTHON dry_run=$DRY quick=$QUICK budget=${BUDGET}s"
START=$SECONDS

# run_step NAME CMD...: run under timeout (min of its default, GPU_CHECK_TIMEOUT_<NAME>, the budget left)
run_step() {
  local name=$1; shift
  local key=${name^^}; key=${key//-/_}
  local var="GPU_CHECK_TIMEOUT_$key"
  local tmo=${!var:-${TMO[$name]}}
  local left=$((BUDGET - (SECONDS - START) - RESERVE))
  if ((left < MIN_STEP)); then
    echo "SKIPPED step $name: ${left}s of the ${BUDGET}s budget left"
    printf '%s\t%s\t%s\t%s\n' "$name" "0s" "SKIPPED" "budget exhausted" >>"$OUTDIR/steps.tsv"
    return 0
  fi
  ((tmo > left)) && tmo=$left
  echo
  echo "=== step $name (timeout ${tmo}s) ==="
  local t0=$SECONDS
  # the part stops starting new cases 20 s before its timeout
  local deadline=$((tmo > 30 ? tmo - 20 : tmo / 2))
  timeout --kill-after=10 "$tmo" "$@" --deadline-s "$deadline" 2>&1 | tee "$OUTDIR/$name.log"
  local rc=${PIPESTATUS[0]}
  local dt=$((SECONDS - t0)) status
  case $rc in
    0) status=PASS ;;
    124|137) status=TIMEOUT ;;
    *) status=FAIL ;;
  esac
  echo "=== step $name: $status (rc=$rc, ${dt}s) ==="
  printf '%s\t%s\t%s\t%s\n' "$name" "${dt}s" "$status" "rc=$rc timeout=${tmo}s" >>"$OUTDIR/steps.tsv"
}

if command -v nvidia-smi >/dev/null 2>&1; then
  timeout 15 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm --format=csv \
    >"$OUTDIR/nvidia-smi.txt" 2>&1 || true
  cat "$OUTDIR/nvidia-smi.txt"
else
  echo "nvidia-smi: not found"
fi

PY_SCRIPT=(scripts/gpu_kernel_check.py "${COMMON[@]}" ${EXTRA[@]+"${EXTRA[@]}"})
run_step env "$PYTHON" "${PY_SCRIPT[@]}" --part env
run_step correctness "$PYTHON" "${PY_SCRIPT[@]}" --part correctness
run_step decode "$PYTHON" "${PY_SCRIPT[@]}" --part decode
run_step prefill "$PYTHON" "${PY_SCRIPT[@]}" --part prefill
if ((QUICK)) && ((!DRY)); then
  run_step prefill-bwd "$PYTHON" "${PY_SCRIPT[@]}" --part prefill-bwd --bwd-lengths 8192 32768
else
  run_step prefill-bwd "$PYTHON" "${PY_SCRIPT[@]}" --part prefill-bwd
fi
((TUNE)) && run_step tune "$PYTHON" "${PY_SCRIPT[@]}" --part tune

echo
echo "=== summary (steps took $((SECONDS - START))s) ==="
timeout 60 "$PYTHON" scripts/gpu_kernel_check.py --part summary --out "$OUTDIR" 2>&1 | tee "$OUTDIR/summary.log"
rc=${PIPESTATUS[0]}
if ((rc != 0)) && [[ ! -s "$OUTDIR/summary.txt" ]]; then
  echo "summary could not be written (rc=$rc); steps:"
  cat "$OUTDIR/steps.tsv"
fi
echo
echo "gpu_check: $([[ $rc -eq 0 ]] && echo PASS || echo FAIL) in $((SECONDS - START))s; results in $OUTDIR" \
  "(summary.txt, summary.json, per-part *.json and *.log)"
exit $rc
