#!/usr/bin/env python
"""Fill the canonical-image cache of a BRAIxDet dataset ahead of training.

Examples:
  python tools/prepare_dataset.py --config-file configs/BRAIxDet/braixdet.yaml --workers 16 \\
      --shard 0/4 DATASETS.BRAIXDET.ROOT /data/CBIS-DDSM
  python tools/prepare_dataset.py --format cbis_ddsm --root /data/CBIS-DDSM \\
      --cache-dir /scratch/cache --size 1536 768 --shard 1/4

What it registers, skips and writes: braixdet/pipeline/prepare.py. Resumable: files whose cache
entry exists are skipped. Bad files are counted and listed one line each. The dataset folder is
only read.
"""
import argparse
import json
import logging
import os
import sys

from braixdet.cli import run_tool
from braixdet.pipeline.prepare import build_prepare_cfg, prepare, run, shard  # noqa: F401 - API


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config-file", default="", help="detectron2 yaml with BRAIxDet keys")
    p.add_argument("--format", choices=["cbis_ddsm", "vindr_mammo", "exam_csv"],
                   help="DATASETS.BRAIXDET.FORMAT (without a config file)")
    p.add_argument("--root", help="DATASETS.BRAIXDET.ROOT")
    p.add_argument("--csv", default="", help="exam_csv: DATASETS.BRAIXDET.CSV")
    p.add_argument("--cache-dir", default="", help="INPUT.BRAIXDET.CACHE_DIR "
                   "(default: the training default, <OUTPUT_DIR>/../cache)")
    p.add_argument("--size", nargs=2, type=int, metavar=("H", "W"),
                   help="INPUT.BRAIXDET.CANONICAL_SIZE")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--shard", default="0/1", help="i/N: process the i-th of N shards")
    p.add_argument("--allow-for-processing", action="store_true",
                   help="INPUT.BRAIXDET.ALLOW_FOR_PROCESSING True")
    p.add_argument("opts", nargs=argparse.REMAINDER, help="config overrides KEY VALUE ...")
    args = p.parse_args(argv)
    try:
        i, n = (int(v) for v in args.shard.split("/"))
        assert 0 <= i < n
    except (ValueError, AssertionError):
        p.error(f"--shard must be i/N with 0 <= i < N, got {args.shard!r}")
    args.shard = (i, n)
    if not args.config_file and not args.format:
        p.error("give --config-file or --format")
    return args


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    cfg = build_prepare_cfg(args.config_file, root=args.root, fmt=args.format, csv=args.csv,
                            size=args.size, cache_dir=args.cache_dir,
                            allow_for_processing=args.allow_for_processing, opts=args.opts)
    try:
        summary = prepare(cfg, *args.shard, workers=args.workers)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
