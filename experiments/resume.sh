#!/usr/bin/env bash
# Every experiment still running across sessions, in the order of their issues, one thread per
# start. At the start of a session, start it once per core, a minute apart:
#   nohup experiments/resume.sh > resume-1.log 2>&1 &
#   sleep 60; nohup experiments/resume.sh > resume-2.log 2>&1 &
# Each start works through the stages below and moves on when a stage has nothing left for it
# (the other start may still be finishing that stage), so no core waits for a hand-made split
# when one stage ends mid-session. Every stage is resumable and skips what has finished; stop a
# start with kill (its current haystack or window is read again next time).
set -uo pipefail  # not -e: a stage another start holds is skipped, not an error
cd "$(dirname "$0")/.."
E=experiments/smollm2_32k
N=experiments/smollm2_32k_neighbours

held() { .venv/bin/python -m experiments.probe_queue --held "$1"; }
stage() {
  echo "$(date -u +%FT%TZ) resume: $*"
  "$@"
}

# Issue 56: E's retrieval redo (the methods split between the starts).
stage "$E/retrieval/run.sh" || exit
# Issue 56, must 6: the needle-driven factor search, then the probes of what it keeps: one
# process (the other start goes on to the next stage while it runs).
search=$E/search/needle-ppl
if ! held "$search" && ! held "$search/probes"; then
  # refused because the other start took it in the same minute: go on to the next stage
  stage "$E/search/run.sh" || held "$search" || held "$search/probes" || exit
fi
# Issue 58: the comparison; a second start joins it (each takes the jobs no other holds).
if held "$N/final"; then
  stage "$N/run.sh" join || exit
else
  stage "$N/run.sh" || stage "$N/run.sh" join || exit  # both looked at once: join the first
fi
# Issue 58: its retrieval on E's redo's probes (the methods split between the starts).
stage "$N/retrieval.sh" || exit
echo "$(date -u +%FT%TZ) resume: every stage has finished or is another start's"
