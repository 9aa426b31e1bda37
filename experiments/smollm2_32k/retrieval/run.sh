#!/usr/bin/env bash
# Experiment E's retrieval redone with probes that measure needle distance (issue 56), for the
# methods E's verdict compares, at seed 0, one thread per start. Resumable: rerun it to
# continue (each `eval probes` folder keeps its answers; a finished one is skipped). Start it
# once per core, a minute apart: each start takes the first method in the order below that
# has not finished and that no other start is probing (experiments/probe_queue.py), so two
# starts split the methods between them. From the repo root:
#   nohup experiments/smollm2_32k/retrieval/run.sh > e-retrieval.log 2>&1 &
#   sleep 60; nohup experiments/smollm2_32k/retrieval/run.sh > e-retrieval-2.log 2>&1 &
# It runs the committed source (HEAD's src/, copied to a temporary folder), so src/ can be
# edited while it runs, and reads each method's extension run in final/methods/ (the adapter
# E scored; the trained methods at the rate E chose, 0.02).
set -euo pipefail
cd "$(dirname "$0")/../../.."
E=experiments/smollm2_32k
OUT=$E/retrieval
source experiments/committed_source.sh
source "$OUT/probes.sh"  # PROBES: the probes, fixed before any answer was seen
# label and extension run: the verdict's pairs first (the leader first), the floor last, since
# a run that stops between sessions has then measured what the verdict needs most
METHODS=(
  "leaky-rerope $E/final/methods/leaky-rerope/s0"
  "dca $E/final/methods/dca/s0"
  "self-extend $E/final/methods/self-extend/s0"
  "yarn-x4 $E/final/methods/yarn-x4/s0"
  "adarope $E/final/methods/adarope/lr-0.02/s0"
  "adarope-global $E/final/methods/adarope-global/lr-0.02/s0"
  "rope $E/final/methods/rope/s0"
)
declare -A RUN=()
LABELS=()
for entry in "${METHODS[@]}"; do
  read -r label run <<<"$entry"
  RUN[$label]=$run
  LABELS+=("$label")
done
while label=$(.venv/bin/python -m experiments.probe_queue "$OUT" "${LABELS[@]}") && [ -n "$label" ]; do
  echo "$(date -u +%FT%TZ) $label"
  .venv/bin/ropekit eval probes --model smollm2-135m --adapter "${RUN[$label]}" "${PROBES[@]}" \
    --out "$OUT/$label" ||
    # refused because another start took the same method in the same instant: take the next
    .venv/bin/python -m experiments.probe_queue --held "$OUT/$label"
done
echo "$(date -u +%FT%TZ) nothing left for this start"
