#!/usr/bin/env bash
# make gpu-check: prove the GPU path on one NVIDIA GPU and measure it, in one
# call of about ten minutes that always writes its summary.
#
# Needs CUDA JAX already installed (jax[cuda13]) and no network: a missing
# dependency (ml_collections, safetensors) is installed from a local wheel
# folder, never from an index. Steps, the measurement first (a GPU is lent
# for minutes, and its first use is the targets' table):
#   1. experiments.bench_msa --device=gpu: ceilings, the reference check
#      (the bf16 kernels against the dense reference), the tune phase (the
#      KV-outer forward's variants at 32k), then the targets cheapest
#      first: prefill 32k (each kernel, stage and variant timed), decode
#      128k at batch 8, forward+backward at 32k, prefill 128k, vs cuDNN;
#      then a trace of one call each, and the Mosaic GPU kernels beside
#      the Triton ones at 32k and 128k.
#      It gets BUDGET less TESTS_TIME_LIMIT: a soft deadline 75 s before
#      its end, past which it starts no phase, and a hard timeout 15 s
#      before it;
#   2. the tests marked `gpu` (MSA Pallas kernels compiled by Triton vs the
#      reference in f32 and bf16; the expert-parallel layer; one RL step),
#      in what is left (at least TESTS_TIME_LIMIT, more when the bench
#      ends early);
#   3. experiments.bench_grouped_gemm --device=gpu, when GEMM_TIME (60 s)
#      is left: the MoE layer's expert compute on one device's rows, the
#      Triton grouped matmul ('pallas') vs XLA's ragged_dot vs a dense
#      batched GEMM, each checked against a float32 reference first. The
#      tests give it only what they have beyond TESTS_TIME_LIMIT;
#   4. one JSON summary line, also written to $RESULTS, whatever happened.
# DRY_RUN=1 runs the same plumbing on CPU (no GPU asserted, the gpu tests
# skip, the bench at toy shapes in interpret mode: tests/test_gpu_check.py).
# Environment: PYTHON (python3), WHEELS (.whl), SITE (/tmp/foremoe_site),
# BUDGET (570 s for the whole call), SEQ_LENS (32768,131072: the targets'
# lengths; the tune phase and each kernel's variants fill the rest of the
# ten minutes), DECODE_LENS (131072), BENCH_REPEATS (5), RESULTS
# (results/gpu_check.json), LOGDIR (/tmp/foremoe_gpu_check), TEST_WORKERS
# (8: the lent machines have 16 cores), TEST_TIMEOUT (300 s per test),
# TESTS_TIME_LIMIT (200 s kept for the tests), GEMM_TIME (60 s for the
# grouped-GEMM bench, 0: none).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/foremoe_site}
SEQ_LENS=${SEQ_LENS:-32768,131072}
DECODE_LENS=${DECODE_LENS:-131072}
BUDGET=${BUDGET:-570}
TESTS_TIME_LIMIT=${TESTS_TIME_LIMIT:-200}
GEMM_TIME=${GEMM_TIME:-60}
START=$SECONDS
RESULTS=${RESULTS:-results/gpu_check.json}
LOGDIR=${LOGDIR:-/tmp/foremoe_gpu_check}
mkdir -p "$LOGDIR" "$(dirname "$RESULTS")"

DRY_RUN=${DRY_RUN:-0}

# The package runs from the checkout (no install); the conftest default
# (JAX_PLATFORMS=cpu) must not win, so the platform is set here.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY_RUN" = 1 ]; then export JAX_PLATFORMS=cpu; else export JAX_PLATFORMS=cuda; fi
export PYTHONUNBUFFERED=1

# Pure-Python or abi3 packages the GPU image may lack, installed from local
# wheels: ml_collections (the bench's configs: needed) and safetensors (the
# checkpoint code the RL-step test imports: without it that test alone is
# lost). Fetch them where there is network:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 -d .whl ml_collections safetensors
missing=$("$PY" -c 'import importlib.util as u; print(" ".join(
    m for m in ("ml_collections", "safetensors") if u.find_spec(m) is None))')
if [ -n "$missing" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  # Only what is missing: a package the image has keeps its own version.
  for m in $missing; do
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps \
        --no-compile --target "$SITE" "$m" \
      || echo "gpu-check: no wheel of $m in $WHEELS/" >&2
  done
  export PYTHONPATH="$PYTHONPATH:$SITE"
fi
if ! "$PY" -c 'import ml_collections' 2>/dev/null; then
  echo "gpu-check: ml_collections is missing and $WHEELS/ holds no wheel of" \
       "it; fetch one where there is network: pip download --no-deps" \
       "--only-binary=:all: --python-version 3.12 -d $WHEELS ml_collections" >&2
  exit 2
fi
"$PY" -c 'import safetensors' 2>/dev/null || echo "gpu-check: safetensors" \
    "is missing (no wheel in $WHEELS/): the RL-step gpu test will not import" >&2

if [ "$DRY_RUN" != 1 ]; then
"$PY" - <<'PY' || { echo 'gpu-check: no CUDA device visible to JAX' >&2; exit 2; }
import jax
assert jax.default_backend() == 'gpu', jax.default_backend()
print('# gpu-check on', jax.devices(), 'jax', jax.__version__)
PY
fi

# The bench first, in BUDGET less what the tests keep: it starts no phase
# in its last 75 s (one 128k measurement can take a minute) and is killed
# 15 s before its end. With no time left it still gets 20 s: its start
# (imports) and the summary of its skipped phases took 4.5-4.9 s on an idle
# 2-core host, and a 5 s kill on a busy one left no summary at all.
bench_budget=$(( BUDGET - TESTS_TIME_LIMIT - (SECONDS - START) ))
timeout $(( bench_budget > 35 ? bench_budget - 15 : 20 )) \
    "$PY" -m experiments.bench_msa --device=gpu --seq_lens="$SEQ_LENS" \
    --decode_lens="$DECODE_LENS" \
    --deadline_s=$(( bench_budget > 75 ? bench_budget - 75 : 0 )) \
    --results_dir="$( [ "$DRY_RUN" = 1 ] && echo "$LOGDIR" || echo results )" \
    $( [ "$DRY_RUN" = 1 ] && echo --dry_run ) \
    ${BENCH_REPEATS:+--repeats="$BENCH_REPEATS"} 2>&1 | tee "$LOGDIR/bench_msa.log"
bench_rc=${PIPESTATUS[0]}

# Triton compiles dominate the test time and run on the host's cores:
# several pytest workers (pytest-xdist, when present) share the one GPU, so
# none may preallocate most of its memory.
# A test file that cannot import on the GPU image costs its own tests only
# (by default pytest stops the whole run at one collection error).
pytest_args=(-q -p no:cacheprovider -m gpu --continue-on-collection-errors
             --junitxml="$LOGDIR/gpu_tests.xml")
if [ "$DRY_RUN" != 1 ] && "$PY" -c 'import xdist' 2>/dev/null; then
  # Tests, not whole files, spread over the workers (the CPU suite's
  # file-per-worker scheduler would put every MSA test on one).
  pytest_args+=(-n "${TEST_WORKERS:-8}" --dist worksteal)
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
fi
# The tests get what is left but 10 s for the summary and the grouped-GEMM
# bench's GEMM_TIME, which they give up only beyond TESTS_TIME_LIMIT. Tests
# not started 40 s before their end are skipped (tests/conftest.py), so
# pytest ends by itself and writes its report.
tests_left=$(( BUDGET - (SECONDS - START) - 10 ))
spare=$(( tests_left - TESTS_TIME_LIMIT ))
(( spare > 0 )) && tests_left=$(( tests_left - (spare < GEMM_TIME ? spare : GEMM_TIME) ))
(( tests_left < 5 )) && tests_left=5
export FOREMOE_TEST_DEADLINE=$(( $(date +%s) + tests_left - 40 ))
if "$PY" -c 'import pytest_timeout' 2>/dev/null; then
  pytest_args+=(--timeout="${TEST_TIMEOUT:-300}")
fi
# Only the *_gpu.py files are collected: the GPU image lacks some CPU-only
# dependencies (grain, tensorboardX, math-verify), and one collection error
# would stop the whole run (tests/test_gpu_check.py checks that every
# `gpu` test lives in such a file).
timeout "$tests_left" \
    "$PY" -m pytest "${pytest_args[@]}" tests/*/*_gpu.py 2>&1 \
    | tee "$LOGDIR/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
unset XLA_PYTHON_CLIENT_PREALLOCATE FOREMOE_TEST_DEADLINE

# The grouped-GEMM bench in what is left but the summary's 10 s: started
# only with 30 s to go, no phase past 15 s before its end.
gemm_left=$(( BUDGET - (SECONDS - START) - 10 ))
gemm_rc=
if (( GEMM_TIME > 0 && gemm_left >= 30 )); then
  timeout "$gemm_left" "$PY" -m experiments.bench_grouped_gemm --device=gpu \
      --deadline_s=$(( gemm_left - 15 )) \
      --results_dir="$( [ "$DRY_RUN" = 1 ] && echo "$LOGDIR" || echo results )" \
      $( [ "$DRY_RUN" = 1 ] && echo --dry_run ) 2>&1 \
    | tee "$LOGDIR/bench_grouped_gemm.log"
  gemm_rc=${PIPESTATUS[0]}
else
  echo "gpu-check: no time left for the grouped-GEMM bench" \
       "(${gemm_left} s)" > "$LOGDIR/bench_grouped_gemm.log"
fi

"$PY" scripts/gpu_check_summary.py --junit="$LOGDIR/gpu_tests.xml" \
    --bench_log="$LOGDIR/bench_msa.log" --tests_rc=$tests_rc \
    --bench_rc=$bench_rc --out="$RESULTS" \
    --gemm_log="$LOGDIR/bench_grouped_gemm.log" ${gemm_rc:+--gemm_rc=$gemm_rc}
