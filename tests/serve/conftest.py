"""The real-engine tests (tests/serve/engines/test_engines.py, test_lm_eval.py and the runners
they start) need vLLM and llama.cpp environments that `make test-serving` builds; the default
suite neither collects nor needs them. The registry's own tests there run everywhere."""

import os

_REAL = [
    "engines/test_engines.py",
    "engines/test_lm_eval.py",
    "engines/test_vllm_remaps.py",
    "engines/run_*.py",
]
collect_ignore_glob = [] if os.environ.get("ROPEKIT_SERVING") else _REAL
