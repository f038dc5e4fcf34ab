#!/usr/bin/env bash
# GPU check: graph tests + 8B-shaped random-weight benchmark with injected acceptance.
# Usage: scripts/gpu_check.sh [--dry-run] [more gpu_check.py flags]; figures go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
exec python scripts/gpu_check.py --out "$OUT" "$@"
