#!/usr/bin/env bash
# Issue 58's retrieval, outside its comparison (README: "Two decisions made before starting"):
# the new methods probed as experiment E's retrieval redo probes E's methods, on the same
# haystacks, needles and cut points, one method after the other, one thread per start.
# Resumable: rerun it to continue (each `eval probes` folder keeps its answers; a finished one
# is skipped). Start it once per core, a minute apart: each start takes the first method in the
# order below that has not finished and that no other start is probing
# (experiments/probe_queue.py). Run it once the comparison (run.sh) has made every method's
# extension run: from the repo root,
#   nohup experiments/smollm2_32k_neighbours/retrieval.sh > n-retrieval.log 2>&1 &
#   sleep 60; nohup experiments/smollm2_32k_neighbours/retrieval.sh > n-retrieval-2.log 2>&1 &
# It runs the committed source (HEAD's src/, copied to a temporary folder).
set -euo pipefail
cd "$(dirname "$0")/../.."
N=experiments/smollm2_32k_neighbours
OUT=$N/retrieval
source experiments/committed_source.sh
source experiments/smollm2_32k/retrieval/probes.sh  # PROBES: E's redo's probes, exactly
# the methods in the order fixed before starting, each read from the comparison's own
# extension run (final/methods/<label>/s0; a trained one at the rate it chose: lr-<rate>/s0)
run_of() {
  local label=$1 methods=$N/final/methods
  if [ -d "$methods/$label/s0" ]; then echo "$methods/$label/s0"; return; fi
  .venv/bin/python - "$N/final/compare.json" "$label" "$methods" <<'PY'
import sys
from ropekit.compare.record import CompareResult
from ropekit.results import read_record
record = read_record(sys.argv[1], CompareResult)
print(f"{sys.argv[3]}/{sys.argv[2]}/lr-{record.lr_search[sys.argv[2]].chosen:g}/s0")
PY
}
LABELS=(adarope-leaky-rerope cope logn harpe ssmax llama4-temperature cope-12 hardclip)
while label=$(.venv/bin/python -m experiments.probe_queue "$OUT" "${LABELS[@]}") && [ -n "$label" ]; do
  run=$(run_of "$label") && [ -d "$run" ] ||
    { echo "no extension run of $label yet: run.sh first" >&2; exit 2; }
  echo "$(date -u +%FT%TZ) $label ($run)"
  .venv/bin/ropekit eval probes --model smollm2-135m --adapter "$run" "${PROBES[@]}" \
    --out "$OUT/$label" ||
    # refused because another start took the same method in the same instant: take the next
    .venv/bin/python -m experiments.probe_queue --held "$OUT/$label"
done
echo "$(date -u +%FT%TZ) nothing left for this start"
