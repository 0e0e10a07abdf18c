#!/usr/bin/env python
"""Regenerate the embedded MNIST subset (src/shiftguard/data/embedded/) from the official IDX files.

    python scripts/make_embedded_mnist.py [--source DIR] [--out DIR] [--check]

Deterministic: the selection rule has no randomness (first 1,000 images of each digit in the
official training file, first 200 of each digit in the official test file, kept in file order),
and the gzip streams are written with level 9 and mtime 0, so rerunning it reproduces the shipped
files byte for byte (``--check`` verifies that without writing anything).
Writes the four gzip IDX files and ``manifest.json`` (provenance: source sha256, rule, counts,
sha256 of the selected indices and of every written file).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from shiftguard.data.embedded import EMBEDDED_FILES, MANIFEST, PER_CLASS, select_balanced  # noqa: E402
from shiftguard.data.idx import encode_idx, load_idx_pair  # noqa: E402
from shiftguard.io import atomic_write_bytes, atomic_write_json, sha256_file  # noqa: E402

SOURCE_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


def default_source() -> Path:
    env = os.environ.get("SHIFTGUARD_SHARED_DATA")
    return (Path(env) if env else REPO.parent / "shared" / "data") / "mnist"


def build(source: Path) -> tuple[dict[str, bytes], dict]:
    files: dict[str, bytes] = {}
    manifest: dict = {
        "name": "mnist-embedded",
        "description": "Class-balanced subset of the official MNIST train and test sets, gzip IDX format.",
        "selection_rule": (
            "per split, for each digit 0..9 the first N images of that digit in the official file order "
            "(N = 1000 for train, taken from train-*-ubyte; N = 200 for test, taken from t10k-*-ubyte); "
            "kept images stay in official order; no randomness"
        ),
        "generator": "scripts/make_embedded_mnist.py",
        "license": "MNIST by Yann LeCun and Corinna Cortes, CC BY-SA 3.0",
        "source": {},
        "splits": {},
        "files": {},
    }
    for split, (img_name, lab_name) in SOURCE_FILES.items():
        img_path, lab_path = source / img_name, source / lab_name
        images, labels = load_idx_pair(img_path, lab_path, 10)
        idx = select_balanced(labels, PER_CLASS[split])
        for p in (img_path, lab_path):
            manifest["source"][p.name] = {
                "sha256": sha256_file(p),
                "content_sha256": hashlib.sha256(gzip.decompress(p.read_bytes())).hexdigest(),
            }
        sel_images, sel_labels = images[idx], labels[idx].astype(np.uint8)
        out_img, out_lab = EMBEDDED_FILES[split]
        files[out_img] = gzip.compress(encode_idx(np.ascontiguousarray(sel_images)), compresslevel=9, mtime=0)
        files[out_lab] = gzip.compress(encode_idx(sel_labels), compresslevel=9, mtime=0)
        manifest["splits"][split] = {
            "source_files": [img_name, lab_name],
            "n": int(len(idx)),
            "per_class": PER_CLASS[split],
            "class_counts": np.bincount(sel_labels, minlength=10).tolist(),
            "first_indices": idx[:10].tolist(),
            "last_index": int(idx[-1]),
            "indices_sha256": hashlib.sha256(idx.astype("<i8").tobytes()).hexdigest(),
            "mean_pixel": round(float(sel_images.mean()), 4),
        }
    for name, data in files.items():
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest["total_bytes"] = sum(len(d) for d in files.values())
    return files, manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=default_source(), help="folder with the official MNIST IDX gz files")
    ap.add_argument("--out", type=Path, default=REPO / "src" / "shiftguard" / "data" / "embedded")
    ap.add_argument("--check", action="store_true", help="only verify that --out matches a fresh build")
    args = ap.parse_args(argv)
    files, manifest = build(args.source)
    if args.check:
        bad = [n for n, d in files.items() if not (args.out / n).is_file() or (args.out / n).read_bytes() != d]
        if bad:
            print(f"MISMATCH: {bad} differ from a fresh build from {args.source}")
            return 1
        print(f"OK: {sorted(files)} in {args.out} match a fresh build from {args.source}")
        return 0
    for name, data in files.items():
        atomic_write_bytes(args.out / name, data)
    atomic_write_json(args.out / MANIFEST, manifest)
    for name in sorted(files):
        print(f"{manifest['files'][name]['bytes']:>9,d}  {manifest['files'][name]['sha256']}  {name}")
    print(f"total {manifest['total_bytes']:,d} bytes in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
