# Sourced (from the repo root) by the experiment scripts that run for hours across sessions:
# sets up .venv when it is missing and installs SmolLM2-135M (both under one lock: two scripts
# may start at once on a fresh checkout, and `models install` refuses a model another process
# is installing rather than waiting for it), and runs ropekit from the committed source (HEAD's
# src/, copied to a temporary folder, first on PYTHONPATH), so src/ can be edited while an
# experiment runs. One thread: the other core is for the tests.
export OMP_NUM_THREADS=1
flock "${TMPDIR:-/tmp}/ropekit-setup.lock" \
  sh -c 'make -s setup && .venv/bin/ropekit models install smollm2-135m' || exit
SRC=$(mktemp -d "${TMPDIR:-/tmp}/ropekit-src.XXXXXX")
git archive HEAD src | tar -x -C "$SRC"
export PYTHONPATH="$SRC/src"
echo "running ropekit from $SRC (HEAD $(git rev-parse --short HEAD))"
