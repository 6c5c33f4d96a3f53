"""Write m2live/data/opbench_grid.json.gz: the standard opbench shape grid, shape columns only.

The grid is the set of shapes measured in ../shared/data/opbench/h100_sxm. Not every opbench GPU was measured on
all of it: the A100's GEMM table has 21 values of M where the H100's and B300's have 76 (4116 of 14504 shapes in
the accuracy region), so each kind also lists ``common``, the indices of the shapes present in *every* opbench
GPU's table — the ones a table of another GPU from the same collector most likely holds. ``m2live calibrate plan``
picks the shapes to measure from those, so the package needs the grid at run time but not the tables: only the
shape columns are kept (deduplicated, sorted), no device, kernel or latency. ``gemm_fp8`` is the same for the fp8
GEMM tables of ../shared/data/opbench_fp8 (the H100's, ``common`` over every fp8 table: H100, B300).

    .venv/bin/python bench/make_grid.py [--src ../shared/data/opbench/h100_sxm] [--fp8-src ../shared/data/opbench_fp8/h100_sxm]
                                        [--out m2live/data/opbench_grid.json.gz]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from m2live.validate import ATTN_COLS, GEMM_COLS, read_table  # noqa: E402

FILES = {"gemm": "gemm_bf16.csv", "prefill": "prefill_attention_bf16.csv", "decode": "decode_attention_bf16.csv"}
FP8_FILES = {"gemm_fp8": "gemm_fp8.csv"}


def _shapes(path: Path, cols: tuple[str, ...]) -> set[tuple[int, ...]]:
    return {tuple(int(float(r[c])) for c in cols) for r in read_table(path).rows}


def grid_from(folder: Path, fp8_folder: Path | None = None) -> dict:
    others = sorted(p for p in folder.parent.iterdir() if p.is_dir())
    out: dict = {"source": f"shape columns of opbench {folder.name}; common: shapes in every table of "
                           f"{', '.join(p.name for p in others)} (bench/make_grid.py)"}
    out.update(_kinds(folder, others, FILES))
    if fp8_folder is not None:
        fp8_others = sorted(p for p in fp8_folder.parent.iterdir() if p.is_dir())
        out["source"] += (f"; gemm_fp8: opbench_fp8 {fp8_folder.name}, common over "
                          f"{', '.join(p.name for p in fp8_others)}")
        for kind, entry in _kinds(fp8_folder, fp8_others, FP8_FILES).items():
            if entry["rows"] == out["gemm"]["rows"]:  # the same grid as bf16's (it is): stored once
                every = len(entry["common"]) == len(entry["rows"])
                entry = {"columns": entry["columns"], "rows_of": "gemm", "common": "all" if every else entry["common"]}
            out[kind] = entry
    return out


def _kinds(folder: Path, others: list[Path], files: dict[str, str]) -> dict:
    out: dict = {}
    for kind, name in files.items():
        cols = ATTN_COLS if "attention" in name else GEMM_COLS
        shapes = sorted(_shapes(folder / name, cols))
        everywhere = set(shapes)
        for p in others:
            everywhere &= _shapes(p / name, cols)
        out[kind] = {"columns": list(cols), "rows": [list(s) for s in shapes],
                     "common": [i for i, s in enumerate(shapes) if s in everywhere]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default=str(ROOT.parent / "shared" / "data" / "opbench" / "h100_sxm"))
    ap.add_argument("--fp8-src", default=str(ROOT.parent / "shared" / "data" / "opbench_fp8" / "h100_sxm"))
    ap.add_argument("--out", default=str(ROOT / "m2live" / "data" / "opbench_grid.json.gz"))
    args = ap.parse_args()
    grid = grid_from(Path(args.src), Path(args.fp8_src))
    # mtime=0: the same grid always gives the same bytes
    with gzip.GzipFile(args.out, "wb", mtime=0) as f:
        f.write(json.dumps(grid, separators=(",", ":")).encode())
    print(f"wrote {args.out}: " + ", ".join(f"{k} {len(grid[grid[k].get('rows_of', k)]['rows'])} shapes ({grid[k]['common'] if grid[k]['common'] == 'all' else len(grid[k]['common'])} common)"
                                            for k in (*FILES, *FP8_FILES)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
