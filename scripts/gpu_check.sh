#!/usr/bin/env bash
# GPU check on a machine with one NVIDIA GPU and no network: install the project offline, then
# measured ceilings, the paper's grid on random-weight targets with injected acceptance (block by
# block, most important first) and the GPU tests (scripts/gpu_check.py says what each stage does;
# docs/gpu.md how to read the results). Results go to $OUT (default ./gpu_check_out):
# gpu_check.json (rewritten after every point), gpu_check.log (everything printed), <= 4 plots.
#
# Usage: bash scripts/gpu_check.sh [gpu_check.py flags]
#   on the GPU:      bash scripts/gpu_check.sh        (about 7.5 minutes: --budget-s 420 plus the install;
#                    device tool timeout_s 540)
#   shorter rerun:   bash scripts/gpu_check.sh --blocks core --skip-tests --budget-s 150
#   rehearsal (CPU): bash scripts/gpu_check.sh --dry-run --skip-tests
#   --require-measured-energy exits 3 before the grid where no counter can be read; without
#   it such a run goes on with modelled energy, labelled MODELLED in every table and plot.
#
# The install needs nothing beyond the machine's python3 (torch, transformers, safetensors,
# tokenizers, numpy, matplotlib, tqdm, setuptools, wheel, nvidia-ml-py): it makes a virtual
# environment under $REFSPEC_VENV (default /tmp/refspec-gpu-venv) that sees those packages
# through a .pth file but runs none of their .pth hooks (so another checkout's editable install
# cannot leak in), then `pip install --no-index --no-deps --no-build-isolation -e .` into it.
# gguf and datasets are not needed. Measured energy needs only nvidia-ml-py (pynvml); to read
# it through Zeus instead, carry its wheel, fetched on a machine with network, in .whl/:
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps zeus==0.16.0 -d .whl
# (zeus imports without its optional extras); every *.whl there is installed offline.
# Clocks, power limits and every other GPU setting are only read, never changed.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
PY=${PYTHON:-python3}
VENV=${REFSPEC_VENV:-/tmp/refspec-gpu-venv}
echo "[gpu_check.sh] $(date -u +%FT%TZ) $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])') in $PWD"

# 1. a virtual environment over the image's packages (where venv itself fails, the image's
#    python, whose machine is bare and given back after the run)
VPY="$VENV/bin/python"
if ! "$PY" -m venv --without-pip --clear "$VENV"; then
  echo "[gpu_check.sh] python -m venv failed: installing into $PY itself"
  VPY="$PY"
fi
[ "$VPY" = "$PY" ] || "$PY" - "$VPY" <<'EOF'
import pathlib, subprocess, sys
purelib = subprocess.check_output([sys.argv[1], "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  text=True).strip()
dirs = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and pathlib.Path(p).is_dir()]
pathlib.Path(purelib, "_refspec_image_packages.pth").write_text("".join(d + "\n" for d in dirs))
print(f"[gpu_check.sh] venv {sys.argv[1]} sees {dirs}")
EOF

# 2. carried wheels (zeus), then the project itself, all offline
if compgen -G ".whl/*.whl" >/dev/null; then
  "$VPY" -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
fi
"$VPY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
"$VPY" -c "import refspec, refspec.models, refspec.drafters, refspec.eval; print('[gpu_check.sh] refspec from', refspec.__path__[0])"

# 3. the check
exec "$VPY" scripts/gpu_check.py --out "$OUT" "$@"
