#!/usr/bin/env bash
# Create .venv with everything the examples and tests need. Idempotent; safe to re-run.
#
# torch is pinned to the 2.13.0 CPU build only where no torch is importable yet: on Intel's Gaudi containers
# torch comes with the Habana bridge and must never be replaced, so there we reuse the system site-packages (and
# install with pip, which counts the container's packages as installed).
# CI's version jobs set TORCH_SPEC/LIGHTNING_SPEC/TRANSFORMERS_SPEC (and VENV) to build the pairings Intel ships.
#
# Elsewhere the packages are installed with uv (`pip install uv` into the venv first): the same packages from the same
# index as pip, several times faster (parallel downloads, no byte-compilation). Measured on the project's 2-core
# machine: torch 2.11.0's public wheel with its CUDA libraries 23 s instead of 55 s, Lightning + the extras 3 s instead
# of 52 s. uv reads no pip.conf: the find-links pip is given (PIP_FIND_LINKS or pip's configuration, e.g. a machine's
# local torch CPU wheel) are passed on. INSTALLER=pip uses pip throughout.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
LIGHTNING_SPEC=${LIGHTNING_SPEC:-lightning==2.6.6}
TRANSFORMERS_SPEC=${TRANSFORMERS_SPEC:-}
VENV=${VENV:-.venv}
INSTALLER=${INSTALLER:-uv}

install() { "$VENV/bin/pip" install -q "$@"; }
if "$PYTHON" -c "import habana_frameworks.torch" >/dev/null 2>&1; then
    echo "Gaudi software stack found: reusing its torch (system site-packages)"
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv --system-site-packages "$VENV"
else
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    if [ "$INSTALLER" = uv ] && { [ -x "$VENV/bin/uv" ] || "$VENV/bin/pip" install -q uv; }; then
        links=${PIP_FIND_LINKS:-$("$VENV/bin/pip" config get global.find-links 2>/dev/null || true)}
        install() {  # pip where uv cannot (an index uv cannot reach: pip's other settings are not passed on)
            UV_FIND_LINKS=${UV_FIND_LINKS:-$links} "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "$@" ||
                { echo "uv failed: installing with pip"; "$VENV/bin/pip" install -q "$@"; }
        }
    fi
    "$VENV/bin/python" -c "import torch" >/dev/null 2>&1 || install "$TORCH_SPEC"
fi
install "$LIGHTNING_SPEC" ${TRANSFORMERS_SPEC:+"$TRANSFORMERS_SPEC"} -e ".[test,examples,benchmarks,docs]"
"$VENV/bin/python" -c "import torch, lightning, lightning_gaudi_fsdp; print('torch', torch.__version__, '| lightning', lightning.__version__, '| lightning-gaudi-fsdp', lightning_gaudi_fsdp.__version__)"
