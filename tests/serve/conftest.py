"""The engine tests (tests/serve/engines) need vLLM and llama.cpp environments that
`make test-serving` builds; the default suite neither collects nor needs them."""

import os

collect_ignore_glob = [] if os.environ.get("ROPEKIT_SERVING") else ["engines/*"]
