"""ropekit.compare: the practitioner's main job in one command, ``ropekit compare``.

Which extension method should serve a target length N, and what does it cost at the original
length? Every method is trained (if it has parameters) on the same samples and seeds, scored
on the same held-out windows of several domains, on whole windows and on their far positions,
and judged by one stated rule with its uncertainty.

- ``config``: ``CompareConfig`` (the question), ``from_file``.
- ``plan``: the methods resolved once, the one list of jobs (``jobs``) and their cost.
- ``ledger``: ``Ledger``, jobs claimed, timed and reused in a folder shared by processes.
- ``comparison``: ``Comparison``, one comparison as the runner holds it, and the runners of
  each kind of job.
- ``run``: ``run_compare`` (the plan run through the ledger, in this process or as Ray
  tasks), ``plan_compare`` (what a run would do, and the compute it would take, without
  running it).
- ``remote``: the jobs as Ray tasks (``--executor ray``, the ``ropekit[ray]`` extra).
- ``assemble``: finished jobs into compare.json and the report.
- ``verdict``: the statistics and the recommendation (pure functions).
- ``report``: report.md and report.html from compare.json.
- ``refresh``: an older compare.json brought up to this verdict (``ropekit report DIR``).
"""

from .config import CompareConfig, from_file
from .run import plan_compare, run_compare
from .verdict import recommend

__all__ = [
    "CompareConfig",
    "from_file",
    "plan_compare",
    "recommend",
    "run_compare",
]
