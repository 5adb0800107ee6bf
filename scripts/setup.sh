#!/usr/bin/env bash
# Create .venv with everything the examples and tests need. Idempotent; safe to re-run.
#
# torch is pinned to the 2.13.0 CPU build only where no torch is importable yet: on Intel's Gaudi containers
# torch comes with the Habana bridge and must never be replaced, so there we reuse the system site-packages.
# CI's version jobs set TORCH_SPEC/LIGHTNING_SPEC/TRANSFORMERS_SPEC (and VENV) to build the pairings Intel ships.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
LIGHTNING_SPEC=${LIGHTNING_SPEC:-lightning==2.6.6}
TRANSFORMERS_SPEC=${TRANSFORMERS_SPEC:-}
VENV=${VENV:-.venv}

if "$PYTHON" -c "import habana_frameworks.torch" >/dev/null 2>&1; then
    echo "Gaudi software stack found: reusing its torch (system site-packages)"
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv --system-site-packages "$VENV"
else
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -c "import torch" >/dev/null 2>&1 || "$VENV/bin/pip" install -q "$TORCH_SPEC"
fi
"$VENV/bin/pip" install -q "$LIGHTNING_SPEC" ${TRANSFORMERS_SPEC:+"$TRANSFORMERS_SPEC"} -e ".[test,examples,benchmarks,docs]"
"$VENV/bin/python" -c "import torch, lightning, lightning_gaudi_fsdp; print('torch', torch.__version__, '| lightning', lightning.__version__, '| lightning-gaudi-fsdp', lightning_gaudi_fsdp.__version__)"
