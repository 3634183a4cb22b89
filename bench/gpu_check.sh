#!/usr/bin/env bash
# The machinery on a GPU in a few minutes (bench/gpu_check.py): HF generate() against Tandem
# at k=0 and k=4 on a random model of the built-in target's shape, and the per-stage split.
#   bench/gpu_check.sh                          # on cuda, the 1.5B shape
#   bench/gpu_check.sh --device cpu --shape tiny --tokens 16 --repeats 1   # the CPU smoke test
# On a machine without Tandem's Python packages, wheels in .whl/ are installed to a scratch
# directory first (pip download them where pip can reach an index). $PYTHON: the interpreter
# (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ -d .whl ] && ! "$PYTHON" -c "import grpc_health, kubernetes, starlette" 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/tandem-site .whl/*.whl
    export PYTHONPATH="/tmp/tandem-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m bench.gpu_check "$@"
