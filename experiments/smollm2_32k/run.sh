#!/usr/bin/env bash
# Experiment E's comparison on one core (resumable: rerun to continue). From the repo root:
#   nohup experiments/smollm2_32k/run.sh > e.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
exec .venv/bin/ropekit compare --config experiments/smollm2_32k/compare.json \
  --out experiments/smollm2_32k/final
