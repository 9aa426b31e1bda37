# Sourced by every script that probes retrieval against experiment E's redo (its run.sh, the
# search's rerun, issue 58's retrieval.sh), so all probe the same haystacks, needles and cut
# points (a haystack's draws depend on the seed, task, length and its index only) and their
# tables compare probe by probe. One needle per haystack (README.md says why), at a seeded
# depth in the first 5% of a haystack of 32k of RULER's essays (niah_single_2), asked from one
# seeded cut point: 56 haystacks a method, each read only up to its cut, about 42 of them past
# the trained 8,192; 8 distance bins of 4k. Fixed before any answer was seen: no probes are
# added after looking.
PROBES=(--lengths 32768 --needles 1 --haystacks 56 --task niah_single_2 --bins 8 --seed 0)
