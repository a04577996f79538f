#!/usr/bin/env bash
# A lent GPU machine's calls (device tool, `run`): each part bounded so a call ends inside the
# 600 s a command may take; everything under $OUT. Prepare here first:
#   ../shared/tools/gpu-wheels pytest pytest-timeout pluggy iniconfig torchao==0.18.0
# then, back to back while the machine is warm (it goes back after 30 s idle):
#   run(command="bash bench/gpu_call.sh tests", carry=[".whl"], timeout_s=330)  # default job + pytest -m gpu
#   run(command="bash bench/gpu_call.sh bench", carry=[".whl"], timeout_s=590)  # python -m bench gpu
# Budgets (seconds) are environment variables: DEFAULT_S, TESTS_S, BENCH_S; BENCH_ARGS adds options.
set -u
part=${1:-all}
OUT=${OUT:-/tmp/gpu-call}; mkdir -p "$OUT"
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
  && export PYTHONPATH=$SITE:$PWD || exit 3
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/stratagem-inductor}
start=$(date +%s)
say() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$OUT/steps.txt"; }
say "machine: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1); $(nproc) cores"
python3 -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "python", sys.version.split()[0])' 2>&1 | tee -a "$OUT/steps.txt"
if [ "$part" = tests ] || [ "$part" = all ]; then
  say "default job (3 steps)"
  timeout "${DEFAULT_S:-100}" python3 train.py trainer.max_steps=3 "hydra.run.dir=$OUT/default" > "$OUT/default.txt" 2>&1
  say "default job exit $?: $(grep -m1 -i 'error' "$OUT/default.txt" | cut -c1-200)"
  say "pytest -m gpu"
  timeout "${TESTS_S:-210}" python3 -m pytest -m gpu -p no:cacheprovider -q -rA --timeout 60 --durations=0 tests/ \
    > "$OUT/pytest-gpu.txt" 2>&1
  say "pytest exit $?: $(tail -1 "$OUT/pytest-gpu.txt")"
fi
if [ "$part" = bench ] || [ "$part" = all ]; then
  say "bench gpu"
  timeout "${BENCH_S:-560}" python3 -m bench gpu --no-ladder --steps 30 --budget "$(( ${BENCH_S:-560} - 90 ))" \
    ${BENCH_ARGS:-} > "$OUT/bench-gpu.txt" 2>&1
  say "bench exit $?"
  cp BENCHMARKS.md "$OUT/" 2>/dev/null
fi
say "done"
