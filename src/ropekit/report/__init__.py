"""ropekit.report: plots and Markdown/HTML reports assembled from result JSON.

Modules:
- `schedules`: RoPE frequency schedules side by side (`ropekit schedules`).
- `document`: report blocks and their Markdown and self-contained HTML renderings.
- `sections`: result JSON found in a run folder, one section builder per kind of result.
- `plots`: figures comparing several runs (methods) against length and position.
- `build`: `build_report(run_dir)`, what `ropekit report` and `ropekit demo` run.

Typical use:

    paths = build_report("runs/demo")   # report.md and report.html beside the results
"""

from .build import ReportPaths, build_report

__all__ = ["ReportPaths", "build_report"]
