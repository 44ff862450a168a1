"""mkdocs hook: the committed benchmark results (plots, tables, logs under ``bench/results/``) become part of the
site without a second copy in ``docs/``, so a page links ``bench/results/...`` exactly as the files lie in the
repository; ``CHANGELOG.md`` becomes the page ``changelog.md``."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".png", ".svg", ".json", ".csv", ".log", ".txt"}  # not .md: a page of its own would need a nav entry


def on_files(files, config):
    for path in sorted((ROOT / "bench" / "results").rglob("*")):
        if path.is_file() and path.suffix in SUFFIXES:
            rel = path.relative_to(ROOT).as_posix()
            files.append(File(rel, src_dir=str(ROOT), dest_dir=config["site_dir"], use_directory_urls=False))
    # the changelog is CHANGELOG.md at the repository's root, shown as a page
    files.append(File.generated(config, "changelog.md", content=(ROOT / "CHANGELOG.md").read_text()))
    return files
