"""A data run's answers kept in the repository: a run folder's ``samples.pt`` as numbered parts of a fixed number of
samples (compressed npz, token ids as uint16), so that a data run longer than a session -- or than a machine's
checkout -- continues from what was committed, and a GPU stage imports them instead of answering the same prompts
again::

    python -m sbd_ext.recipes.drafter.parts save    --work RUN --dest DIR [--part 500]   # each new full part
    python -m sbd_ext.recipes.drafter.parts restore --dest DIR --work RUN                # samples.pt from the parts

``DIR`` holds ``part-000.npz``, ``part-001.npz``, ... (samples ``[i * part, (i + 1) * part)`` of the run, in order)
and ``parts.json`` (the part size and count). Only full parts are written, each once: a part already in ``DIR`` must
equal the run's samples at its place (a run folder of other prompts or settings is refused), so ``save`` after every
few batches adds what is new. ``restore`` writes ``samples.pt`` from the parts where the run folder has fewer
samples (and refuses a run folder whose samples disagree with them); ``data`` then continues after them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from .args import count
from .bases import SAMPLES_FILE

MANIFEST = "parts.json"


def export_samples(samples: list[dict], path: Path) -> None:
    """``samples.pt`` rows as one compressed npz: token ids as uint16 (vocabularies under 65,536), offsets, sources
    and prompts (JSON)."""
    ids = [list(s["prompt_ids"]) + list(s["answer_ids"]) for s in samples]
    if any(t < 0 or t > 65535 for x in ids for t in x):
        raise ValueError("export_samples: a token id outside uint16")
    flat = np.array([t for x in ids for t in x], dtype=np.uint16)
    meta = [{k: v for k, v in s.items() if k not in ("prompt_ids", "answer_ids")} for s in samples]
    np.savez_compressed(
        path,
        tokens=flat,
        lengths=np.array([len(x) for x in ids], dtype=np.int32),
        prompt_lengths=np.array([len(s["prompt_ids"]) for s in samples], dtype=np.int32),
        meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
    )


def import_samples(path: Path) -> list[dict]:
    """The rows :func:`export_samples` wrote (a file), or every part of a folder :func:`save_parts` wrote, in
    order."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file or folder of sample parts")
    if path.is_dir():
        return [row for part in _part_files(path) for row in import_samples(part)]
    z = np.load(path)
    meta = json.loads(z["meta"].tobytes().decode())
    out, lo = [], 0
    for m, n, p in zip(meta, z["lengths"].tolist(), z["prompt_lengths"].tolist(), strict=True):
        x = z["tokens"][lo : lo + n].astype(np.int64).tolist()
        out.append(m | {"prompt_ids": x[:p], "answer_ids": x[p:]})
        lo += n
    return out


def _part_files(dest: Path) -> list[Path]:
    """The parts of ``dest`` in order, checked against its manifest (a missing or extra part is refused)."""
    f = dest / MANIFEST
    if not f.is_file():
        raise ValueError(f"{dest} holds no {MANIFEST}: not a folder of sample parts")
    n = json.loads(f.read_text())["parts"]
    files = [dest / f"part-{i:03d}.npz" for i in range(n)]
    missing = [p.name for p in files if not p.is_file()]
    if missing:
        raise ValueError(f"{dest}: {MANIFEST} lists {n} parts, missing {missing}")
    return files


def save_parts(work: Path, dest: Path, part: int = 500) -> list[Path]:
    """Each full part of ``work/samples.pt`` that ``dest`` lacks, written; returns the new files. The parts already
    there must equal the run's samples at their places and have the same size."""
    if part < 1:
        raise ValueError(f"part must be >= 1, got {part}")
    rows = torch.load(Path(work) / SAMPLES_FILE, weights_only=True)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    have = 0
    if (dest / MANIFEST).is_file():
        man = json.loads((dest / MANIFEST).read_text())
        if man["part"] != part:
            raise ValueError(f"{dest} holds parts of {man['part']} samples, not {part}")
        have = man["parts"]
        for i, f in enumerate(_part_files(dest)):
            if import_samples(f) != rows[i * part : (i + 1) * part]:
                raise ValueError(f"{f} differs from {work}'s samples at its place: another run's parts")
    new = []
    for i in range(have, len(rows) // part):
        f = dest / f"part-{i:03d}.npz"
        export_samples(rows[i * part : (i + 1) * part], f)
        new.append(f)
    if new or not (dest / MANIFEST).is_file():
        n = have + len(new)
        answer_tokens = sum(len(r["answer_ids"]) for r in rows[: n * part])
        man = {"part": part, "parts": n, "samples": n * part, "answer_tokens": answer_tokens}
        (dest / MANIFEST).write_text(json.dumps(man, indent=1) + "\n")
    return new


def restore_parts(dest: Path, work: Path) -> int:
    """``work/samples.pt`` from the parts of ``dest`` where it has fewer samples (its samples must be where the
    parts begin); returns the samples it holds now."""
    rows = import_samples(Path(dest))
    path = Path(work) / SAMPLES_FILE
    have = torch.load(path, weights_only=True) if path.is_file() else []
    n = min(len(have), len(rows))
    if have[:n] != rows[:n]:
        raise ValueError(f"{path} differs from the parts in {dest}: another run's samples")
    if len(rows) > len(have):
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(rows, path)
        return len(rows)
    return len(have)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sbd_ext.recipes.drafter.parts", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save", help="write each new full part of RUN/samples.pt into DIR")
    s.add_argument("--work", required=True)
    s.add_argument("--dest", required=True)
    s.add_argument("--part", type=count(1), default=500, help="samples per part")
    r = sub.add_parser("restore", help="RUN/samples.pt from the parts in DIR")
    r.add_argument("--dest", required=True)
    r.add_argument("--work", required=True)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "save":
            new = save_parts(Path(a.work), Path(a.dest), a.part)
            print(f"{len(new)} new part(s) in {a.dest}: {', '.join(p.name for p in new) or '-'}")
        else:
            print(f"{a.work}/{SAMPLES_FILE}: {restore_parts(Path(a.dest), Path(a.work))} samples")
    except (ValueError, FileNotFoundError) as e:
        print(f"{ap.prog} {a.cmd}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
