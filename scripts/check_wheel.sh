#!/usr/bin/env bash
# The release check: build the sdist and the wheel, check their metadata (twine), then install the WHEEL (not the
# tree) with its `cli` extra into a fresh virtual environment and, from a directory where the tree's `src/` cannot be
# imported, run `lightning-gaudi-fsdp doctor`, a 2-process CPU training that saves a sharded checkpoint and resumes
# from it (scripts/wheel_smoke.py), and `lightning-gaudi-fsdp inspect` on that checkpoint. A file missing from the
# wheel (a module, `py.typed`, the license) fails here, not at a user's.
#
# Usage: bash scripts/check_wheel.sh   (after scripts/setup.sh; PYTHON: the fresh venv's interpreter, TORCH_SPEC: its
# torch, TOOLS_PYTHON: the interpreter that builds, default .venv's)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

tools=${TOOLS_PYTHON:-.venv/bin/python}  # builds and checks; scripts/setup.sh installs build and twine (test extra)
"$tools" -c "import build, twine" 2>/dev/null || "$tools" -m pip install -q "build>=1" "twine>=5"

echo "-- build (sdist + wheel)"
"$tools" -m build --outdir "$WORK/dist" . > "$WORK/build.log" 2>&1 || { tail -n 40 "$WORK/build.log"; exit 1; }
"$tools" -m twine check --strict "$WORK"/dist/*
wheel=$(ls "$WORK"/dist/*.whl)
sdist=$(ls "$WORK"/dist/*.tar.gz)

echo "-- contents"
"$tools" - "$wheel" "$sdist" <<'EOF'
import sys, tarfile, zipfile

wheel, sdist = sys.argv[1:3]
names = zipfile.ZipFile(wheel).namelist()
need = ["lightning_gaudi_fsdp/py.typed", "lightning_gaudi_fsdp/cli.py", "lightning_gaudi_fsdp/checkpoint/__init__.py",
        "lightning_gaudi_fsdp/engine/__init__.py", "lightning_gaudi_fsdp/adapters/__init__.py"]
missing = [n for n in need if n not in names]
missing += [] if any(n.endswith(".dist-info/licenses/LICENSE") for n in names) else ["<dist-info>/licenses/LICENSE"]
metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
for field in ("License-Expression: Apache-2.0", "Classifier: Typing :: Typed", "Provides-Extra: cli",
              "Provides-Extra: examples", "Keywords:"):
    if field not in metadata:
        missing.append(f"METADATA {field!r}")
sdist_names = tarfile.open(sdist).getnames()
missing += [f"sdist {n}" for n in ("LICENSE", "README.md") if not any(s.endswith("/" + n) for s in sdist_names)]
if missing:
    sys.exit(f"the built distributions lack: {missing}")
print(f"{wheel.rsplit('/', 1)[-1]}: {len(names)} files, py.typed, LICENSE and metadata present")
EOF

echo "-- install the wheel into a fresh environment"
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q "$TORCH_SPEC"
"$WORK/venv/bin/pip" install -q "$wheel[cli]"

cd "$WORK"  # the tree's src/ is not importable from here
cp "$ROOT/scripts/wheel_smoke.py" "$WORK/"
export PATH="$WORK/venv/bin:$PATH"
unset PYTHONPATH
echo "-- doctor"
lightning-gaudi-fsdp doctor --accelerator cpu
echo "-- train, save sharded, resume (2 CPU processes)"
python wheel_smoke.py train "$WORK/ckpt"
python wheel_smoke.py resume "$WORK/ckpt"
echo "-- inspect"
lightning-gaudi-fsdp inspect "$WORK/ckpt/last.ckpt"
echo "wheel check passed"
