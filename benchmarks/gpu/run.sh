#!/usr/bin/env bash
# Issue 56's GPU run as one command, for a lent CUDA machine (no network there): run from the
# repository's root as  OUT=/some/dir bash benchmarks/gpu/run.sh  and keep what it writes.
#   1. `make test-gpu` without make's venv: the tests marked `cuda`, then every notebook and
#      solution under nbval-lax on the GPU, each file's seconds and the total (target: 600 s);
#   2. `bench-batch` on the GPU: a bf16 decode step of GPT-2 small's shape against batch size
#      at two contexts, beside the roofline (benchmarks/gpu/batch once committed);
#   3. `bench-compile` on the GPU: the fixed-shape decode step eager, compiled, and replayed
#      as a CUDA graph; the server's decode step at batch 1, 8, 64 eager, at fixed shapes, and
#      replayed as one CUDA graph a batch size (benchmarks/gpu/compile once committed);
#   4. `bench-syncs` on the GPU: each decoder's waits for the device as the CPU counts them,
#      beside CUDA's own count of synchronising calls (benchmarks/gpu/syncs once committed).
# Each step's log goes to $OUT; a failed step is recorded and the next one still runs.
# One device call may run 10 minutes at most: name the steps to run in this call, e.g.
#   bash benchmarks/gpu/run.sh test-gpu   then   bash benchmarks/gpu/run.sh batch compile syncs
# (default: all four).
set -u -o pipefail
STEPS=" ${*:-test-gpu batch compile syncs} "
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
NBFLAGS="--nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg"
$PY - <<'PYEOF' 2>&1 | tee "$OUT/env.txt"
import importlib, platform, torch
print(platform.platform(), "torch", torch.__version__, "cuda", torch.cuda.is_available())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(), torch.cuda.mem_get_info())
for name in ("pytest", "nbval", "ipykernel", "matplotlib", "ipywidgets", "tiktoken", "triton"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # noqa: BLE001 - report every missing piece, then go on
        print(name, "MISSING:", e)
PYEOF
if [[ $STEPS == *" test-gpu "* ]]; then
start=$(date +%s)
$PY -m pytest -q -m cuda tests 2>&1 | tee "$OUT/cuda-tests.log"
echo "cuda tests: rc ${PIPESTATUS[0]}, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
nb_start=$(date +%s)
MINIKV_DEVICE=cuda $PY -m pytest -q $NBFLAGS --durations=0 notebooks/*.ipynb solutions/*.ipynb \
    2>&1 | tee "$OUT/notebooks.log"
echo "notebooks and solutions on the GPU: rc ${PIPESTATUS[0]}, $(( $(date +%s) - nb_start )) s" \
    | tee -a "$OUT/summary.txt"
echo "test-gpu in all: $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
fi
if [[ $STEPS == *" batch "* ]]; then
$PY -m minikv bench-batch --device cuda --out "$OUT/batch" 2>&1 | tee "$OUT/bench-batch.log"
echo "bench-batch: rc ${PIPESTATUS[0]}" | tee -a "$OUT/summary.txt"
fi
if [[ $STEPS == *" compile "* ]]; then
$PY -m minikv bench-compile --device cuda --out "$OUT/compile" 2>&1 | tee "$OUT/bench-compile.log"
echo "bench-compile: rc ${PIPESTATUS[0]}" | tee -a "$OUT/summary.txt"
fi
if [[ $STEPS == *" syncs "* ]]; then
$PY -m minikv bench-syncs --device cuda --out "$OUT/syncs" 2>&1 | tee "$OUT/bench-syncs.log"
echo "bench-syncs: rc ${PIPESTATUS[0]}" | tee -a "$OUT/summary.txt"
fi
