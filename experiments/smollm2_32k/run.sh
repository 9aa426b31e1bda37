#!/usr/bin/env bash
# Experiment E's comparison on one core (resumable: rerun to continue). From the repo root:
#   nohup experiments/smollm2_32k/run.sh > e.log 2>&1 &          # the comparison, final/
#   nohup experiments/smollm2_32k/run.sh join > e2.log 2>&1 &     # a second core on it
# `join` runs the same comparison with --join: each process takes the jobs the other does not
# hold. (Until 2026-12-05 the second core ran stage 2 as a comparison of its own, `stage2`,
# into stage2/, which started with the unmodified model's finished jobs copied from final/;
# `python -m experiments.smollm2_32k.merge` copied its finished jobs into final/.)
# From nothing: it sets up .venv and installs the model when they are missing (a new
# checkout has neither), and it runs the committed source (HEAD's src/, copied to a temporary
# folder), so src/ can be edited while it runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
E=experiments/smollm2_32k
case "${1:-final}" in final | join | stage2) ;; *) echo "usage: $0 [final|join|stage2]" >&2; exit 2 ;; esac
source experiments/committed_source.sh
case "${1:-final}" in
  final) exec .venv/bin/ropekit compare --config "$E/compare.json" --out "$E/final" ;;
  join) exec .venv/bin/ropekit compare --config "$E/compare.json" --out "$E/final" --join ;;
  stage2)
    mkdir -p "$E/stage2/methods" "$E/stage2/eval"
    [ -e "$E/stage2/methods/rope" ] || cp -r "$E/final/methods/rope" "$E/stage2/methods/"
    [ -e "$E/stage2/eval/rope" ] || cp -r "$E/final/eval/rope" "$E/stage2/eval/"
    exec .venv/bin/ropekit compare --config "$E/stage2.json" --out "$E/stage2" ;;
esac
