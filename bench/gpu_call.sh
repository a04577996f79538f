#!/usr/bin/env bash
# One call on a lent GPU machine (device tool, `run`): the default job, the GPU-marked tests and
# `python -m bench gpu`, each bounded so the call ends inside its limit; everything under $OUT.
# Prepare here first: ../shared/tools/gpu-wheels pytest pytest-timeout pluggy iniconfig [torchao==X]
# then: run(command="bash bench/gpu_call.sh", carry=[".whl"], timeout_s=590)
# Budgets (seconds) are environment variables: DEFAULT_S, TESTS_S, BENCH_S.
set -u
OUT=${OUT:-/tmp/gpu-call}; mkdir -p "$OUT"
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
  && export PYTHONPATH=$SITE:$PWD || exit 3
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
start=$(date +%s)
say() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$OUT/steps.txt"; }
say "machine: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"
python3 -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "python", sys.version.split()[0])' 2>&1 | tee -a "$OUT/steps.txt"
say "default job (5 steps)"
timeout "${DEFAULT_S:-90}" python3 train.py trainer.max_steps=5 "hydra.run.dir=$OUT/default" > "$OUT/default.txt" 2>&1
say "default job exit $?"
say "pytest -m gpu"
timeout "${TESTS_S:-200}" python3 -m pytest -m gpu -p no:cacheprovider -q -rA --timeout 150 tests/ > "$OUT/pytest-gpu.txt" 2>&1
say "pytest exit $?: $(tail -1 "$OUT/pytest-gpu.txt")"
say "bench gpu"
timeout "${BENCH_S:-300}" python3 -m bench gpu --no-ladder --budget "$(( ${BENCH_S:-300} - 70 ))" ${BENCH_ARGS:-} > "$OUT/bench-gpu.txt" 2>&1
say "bench exit $?"
cp BENCHMARKS.md "$OUT/" 2>/dev/null
say "done"
