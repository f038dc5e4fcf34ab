#!/usr/bin/env bash
# Set up refspec on a fresh machine: the CPU build of PyTorch where no NVIDIA GPU is present
# (so pip does not pull a multi-GB CUDA wheel), then refspec with the extras the default run and
# the tests need (assets: gguf, corpora: datasets, serve: starlette, uvicorn; test: pytest, the
# serving clients openai and guidellm), and gpu (zeus, nvidia-ml-py) on a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch>=2.4"
  else
    "$PY" -m pip install --quiet "torch==2.13.0"
  fi
fi
EXTRAS=assets,corpora,serve,test
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  EXTRAS=$EXTRAS,gpu
fi
"$PY" -m pip install --quiet -e ".[$EXTRAS]"
