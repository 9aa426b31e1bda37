#!/usr/bin/env bash
# Issue 58's comparison on one core (resumable: rerun to continue). From the repo root:
#   nohup experiments/smollm2_32k_neighbours/run.sh > n.log 2>&1 &        # final/
#   nohup experiments/smollm2_32k_neighbours/run.sh join > n2.log 2>&1 &   # a second core on it
# The methods experiment E finished (rope, yarn-x4, leaky-rerope, adarope, adarope-global) are
# not computed again: their jobs are copied from ../smollm2_32k/final/ before the first start,
# and compare reuses a job by its provenance. It runs the committed source (HEAD's src/, copied
# to a temporary folder), so src/ can be edited while it runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
N=experiments/smollm2_32k_neighbours
E=experiments/smollm2_32k
case "${1:-final}" in final | join) ;; *) echo "usage: $0 [final|join]" >&2; exit 2 ;; esac
mkdir -p "$N/final/methods" "$N/final/eval"
for m in rope yarn-x4 leaky-rerope adarope adarope-global; do
  [ -e "$N/final/methods/$m" ] || cp -r "$E/final/methods/$m" "$N/final/methods/"
  [ -e "$N/final/eval/$m" ] || cp -r "$E/final/eval/$m" "$N/final/eval/"
done
source experiments/committed_source.sh
case "${1:-final}" in
  final) exec .venv/bin/ropekit compare --config "$N/compare.json" --out "$N/final" ;;
  join) exec .venv/bin/ropekit compare --config "$N/compare.json" --out "$N/final" --join ;;
esac
