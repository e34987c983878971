#!/usr/bin/env bash
# Run on the GPU machine: the whole test suite (GPU tests included), the demo
# on a 2 GiB cache, and the benchmark. Results land in $OUT (or ./out).
# TESTS_ONLY=1 skips demo and bench; PYTEST_ARGS picks tests.
# Installs the wheels found in .whl/ (the machine reaches no package index).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
# Wheels the machine lacks (pytest-asyncio, trio, the vLLM test dependencies, ...) and vLLM's
# Python files as a zip (imported from the zip: its compiled parts are not needed here).
if ls .whl/*.whl >/dev/null 2>&1; then
  site=$(mktemp -d) && python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl && export PYTHONPATH=$site:$PYTHONPATH
fi
[ -f .whl/vllm_py.zip ] && export PYTHONPATH=$PYTHONPATH:$PWD/.whl/vllm_py.zip
# The compiled modules, built in place (as `pip install -e .` does) for the tests run from src/.
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cuda-bindings', cuda.bindings.__version__)" | tee -a "$OUT/machine.txt"
rc=0
python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-tests} 2>&1 | tee "$OUT/pytest.log" || rc=1
[ -n "${TESTS_ONLY:-}" ] && exit $rc
python3 -m kvoffload.cli demo --gib ${DEMO_GIB:-2} 2>&1 | tee "$OUT/demo.log" || rc=1
plot=""; python3 -c "import matplotlib" 2>/dev/null && plot="--plot $OUT/bench.png"
python3 -m kvoffload.cli bench --json "$OUT/bench.json" $plot ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60 || rc=1
exit $rc
