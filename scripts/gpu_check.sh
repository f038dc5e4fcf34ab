#!/usr/bin/env bash
# The paper's claims on a lent GPU with no network: install the project offline, then
# `python -m refspec.eval paper` (docs/gpu.md), then the phase loops checked by a fit over three mixes
# (scripts/mix_check.py). Results go to $OUT (default ./paper_out): claims.md, claims.json,
# results.json (all rewritten after every variant), four plots and paper.log (the mix check's lines too).
#
# Usage: bash scripts/gpu_check.sh [python -m refspec.eval paper flags]
#   on the GPU:      bash scripts/gpu_check.sh             (plans 524 s in all; device tool timeout_s 540)
# On a GPU the mix check gets what is left of $GPU_CHECK_S (default 540 s, the device call's limit)
# less 10 s, so the call ends with every mix it finished in paper.log rather than cut off mid-write.
#   shorter rerun:   bash scripts/gpu_check.sh --blocks core --budget-s 150
#   rehearsal (CPU): bash scripts/gpu_check.sh --device cpu --quick
#
# The install needs nothing beyond the machine's python3 (torch, transformers, safetensors,
# tokenizers, numpy, matplotlib, tqdm, setuptools, nvidia-ml-py): it makes a virtual environment
# under $REFSPEC_VENV (default /tmp/refspec-gpu-venv) that sees those packages through a .pth file
# but runs none of their .pth hooks (so another checkout's editable install cannot leak in), then
# `pip install --no-index --no-deps --no-build-isolation -e .` into it. To read the counter through
# Zeus instead of pynvml, carry its wheel (fetched where there is network) in .whl/:
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps zeus==0.16.0 -d .whl
# Clocks, power limits and every other GPU setting are only read, never changed.
set -euo pipefail
T0=$(date +%s)
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/paper_out}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/paper.log") 2>&1
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
PY=${PYTHON:-python3}
VENV=${REFSPEC_VENV:-/tmp/refspec-gpu-venv}
echo "[gpu_check.sh] $(date -u +%FT%TZ) $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])') in $PWD"

# 1. a virtual environment over the image's packages (where venv itself fails, the image's python)
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

# 3. the claims
"$VPY" -m refspec.eval paper --out "$OUT" "$@"

# 4. the phase loops checked by one fit over three K x batch mixes (scripts/mix_check.py): on the GPU's
#    counter, loops of at least max(10 periods, 1 s); where no GPU answers, a toy on a simulated counter.
#    Its lines land in paper.log; its ledgers stay in $MIX_DIR (the device returns at most 8 files).
MIX_DIR=${MIX_DIR:-/tmp/refspec-mix}
CAP=()
if "$VPY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  MIX=(--device cuda --meter nvml)
  LEFT=$(( ${GPU_CHECK_S:-540} - 10 - ($(date +%s) - T0) ))
  if (( LEFT < 20 )); then
    echo "[gpu_check.sh] $(date -u +%FT%TZ) no mix check: ${LEFT} s left of ${GPU_CHECK_S:-540} s"
    exit 0
  fi
  CAP=(timeout "$LEFT")
else
  MIX=(--device cpu --toy --meter simulated:cpu:period_ms=10:sample_ms=10 --mixes 4x8,2x4,6x6 --requests-per-slot 2
       --max-new-tokens 16)
fi
echo "[gpu_check.sh] $(date -u +%FT%TZ) mix check: ${MIX[*]}"
rc=0
${CAP[@]+"${CAP[@]}"} "$VPY" scripts/mix_check.py --out "$MIX_DIR" "${MIX[@]}" || rc=$?
if (( rc == 124 )); then  # timeout's code, which the device tool would read as its own limit
  echo "[gpu_check.sh] $(date -u +%FT%TZ) mix check stopped at its ${LEFT} s cap: the mixes it finished are above"
  exit 0
fi
exit "$rc"
