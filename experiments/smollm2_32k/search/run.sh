#!/usr/bin/env bash
# Experiment E's factor search at 32k redone with LongRoPE2's needle-driven perplexity (issue
# 56, must 6): the same search as search/ (the three seeds PI, NTK-aware and YaRN plus their
# mutations, one generation) scored by the NLL of the answer tokens of needle documents instead
# of every token's. Resumable: rerun it to continue (candidates.jsonl keeps every scored
# candidate; a finished search makes no forward). Not run yet: see README.md here for its cost.
# From the repo root:
#   nohup experiments/smollm2_32k/search/run.sh > e-search-needle.log 2>&1 &
# It runs the committed source (HEAD's src/, copied to a temporary folder), so src/ can be
# edited while it runs.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=experiments/smollm2_32k/search/needle-ppl
source experiments/committed_source.sh
# Fixed before any score is seen: 6 needle documents of 32,768 tokens (each its own passkey,
# six independent probes; each needle more than 8,192 tokens back: 12.7k-31.5k, README.md) score each of 4
# candidates (the three seeds and one mutation): a budget of 24 forwards at 32k.
.venv/bin/ropekit search --model smollm2-135m --target-length 32768 --samples 6 --budget 24 \
  --objective needle-ppl --out "$OUT"
# Which factors it kept, and whether they reach: the kept adapter probed as retrieval/ probes
# the methods of E's verdict (same haystacks, needles and cut points, so the tables compare).
source experiments/smollm2_32k/retrieval/probes.sh  # PROBES
.venv/bin/ropekit eval probes --model smollm2-135m --adapter "$OUT/adapter" "${PROBES[@]}" \
  --out "$OUT/probes"
echo "$(date -u +%FT%TZ) done"
