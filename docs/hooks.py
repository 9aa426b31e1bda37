"""mkdocs hooks: the pages that live outside docs/ join the site where they are.

The experiments' READMEs stay the record of each experiment, next to their results
(experiments/<name>/README.md), and RELIABILITY.md stays at the top of the repository. They
are added to the site under the same paths, with the files they link to (figures, result
JSON, reports), so their relative links resolve as they do on disk: nothing is copied into
docs/, so nothing can go stale.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
# what the experiment READMEs link to or show; model weights and job records stay out
MOUNTED = {".md", ".png", ".json", ".html"}


def on_files(files: Files, config) -> Files:
    paths = [ROOT / "RELIABILITY.md"]
    paths += sorted(
        p for p in (ROOT / "experiments").rglob("*") if p.is_file() and p.suffix in MOUNTED
    )
    for path in paths:
        files.append(
            File(
                path.relative_to(ROOT).as_posix(),
                src_dir=str(ROOT),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files
