#!/usr/bin/env python
"""Fill the canonical-image cache of registered BRAIxDet dataset(s) ahead of training.

Examples:
  python tools/prepare_dataset.py --config-file configs/BRAIxDet/xxx.yaml --workers 8
  python tools/prepare_dataset.py --format cbis_ddsm --root /data/CBIS-DDSM \\
      --cache-dir /scratch/cache --size 1536 768 --shard 0/4

Every main and auxiliary image of every registered split is processed once (sorted unique file
list; ``--shard i/N`` takes every N-th file from i, so N machines split the work). Bad files are
counted and listed one line each; the tool never stops on one.
"""
import argparse
import json
import logging
import multiprocessing as mp
import os
import sys
import time

from tqdm import tqdm

from braixdet.data.cache import CanonicalCache
from braixdet.data.preprocess import PreprocessParams
from braixdet.data.report import BadInputError, BadInputReport

logger = logging.getLogger("prepare_dataset")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config-file", help="detectron2 yaml with BRAIxDet keys")
    src.add_argument("--format", choices=["cbis_ddsm", "vindr_mammo", "exam_csv"])
    p.add_argument("--root", help="dataset root (with --format)")
    p.add_argument("--csv", default="", help="exam_csv: the CSV file")
    p.add_argument("--cache-dir", default="", help="cache folder (default: from the config)")
    p.add_argument("--size", nargs=2, type=int, metavar=("H", "W"), help="canonical size")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--shard", default="0/1", help="i/N: process the i-th of N shards")
    p.add_argument("--allow-for-processing", action="store_true")
    p.add_argument("opts", nargs=argparse.REMAINDER, help="config overrides KEY VALUE ...")
    args = p.parse_args(argv)
    try:
        i, n = (int(v) for v in args.shard.split("/"))
        assert 0 <= i < n
    except (ValueError, AssertionError):
        p.error(f"--shard must be i/N with 0 <= i < N, got {args.shard!r}")
    args.shard = (i, n)
    if args.format and not args.root:
        p.error("--format needs --root")
    return args


def _load_cfg(args):
    from detectron2.config import get_cfg

    from braixdet.config import add_braixdet_config

    cfg = get_cfg()
    add_braixdet_config(cfg)
    if args.config_file:
        cfg.merge_from_file(args.config_file)
    if args.format:
        cfg.DATASETS.BRAIXDET.FORMAT = args.format
        cfg.DATASETS.BRAIXDET.ROOT = args.root
        cfg.DATASETS.BRAIXDET.CSV = args.csv
    if args.opts:
        cfg.merge_from_list(args.opts)
    if args.size:
        cfg.INPUT.BRAIXDET.CANONICAL_SIZE = tuple(args.size)
    if args.cache_dir:
        cfg.INPUT.BRAIXDET.CACHE_DIR = args.cache_dir
    if args.allow_for_processing:
        cfg.INPUT.BRAIXDET.ALLOW_FOR_PROCESSING = True
    return cfg


def default_cache_dir(cfg):
    """INPUT.BRAIXDET.CACHE_DIR, else <OUTPUT_DIR>/../cache (never inside the dataset root)."""
    d = cfg.INPUT.BRAIXDET.CACHE_DIR
    return d or os.path.join(os.path.dirname(os.path.abspath(cfg.OUTPUT_DIR)), "cache")


def collect_items(dataset_names):
    """Sorted unique (file_name, laterality) of main and aux images of the datasets."""
    from detectron2.data import DatasetCatalog

    items = {}
    for name in dataset_names:
        for d in DatasetCatalog.get(name):
            lat = d.get("laterality")
            for key in ("file_name", "aux_file_name"):  # aux is ipsilateral: same laterality
                f = d.get(key)
                if f:
                    items.setdefault(os.path.abspath(f), lat)
    return sorted(items.items())


def shard(items, i, n):
    return items[i::n]


_CACHE = None


def _init_worker(cache_dir, params, allow_for_processing, fmt="npy"):
    global _CACHE
    import cv2

    cv2.setNumThreads(1)  # parallelism comes from the processes
    logging.getLogger("braixdet").setLevel(logging.ERROR)  # keep the progress bar readable
    _CACHE = CanonicalCache(cache_dir, params, allow_for_processing=allow_for_processing, fmt=fmt)


def _work(item):
    path, lat = item
    try:
        _, _, info = _CACHE.get_with_info(path, lat)
        return path, None, bool(info.get("laterality_disagreement"))
    except BadInputError as e:
        return path, (e.reason, e.detail), False
    except Exception as e:  # noqa: BLE001 - one bad file never stops the run
        return path, ("unsupported", f"{type(e).__name__}: {e}".splitlines()[0][:200]), False


def run(items, cache_dir, params, workers=1, allow_for_processing=False, report=None,
        fmt="npy"):
    """Process ``items`` [(path, laterality)]; returns the BadInputReport."""
    report = report or BadInputReport("prepare_dataset")
    # Bad files are listed after the progress bar instead of interleaved with it.
    report_logger = logging.getLogger("braixdet.data.report")
    old_level = report_logger.level
    report_logger.setLevel(logging.ERROR)
    init = (cache_dir, params, allow_for_processing, fmt)
    if workers <= 1:
        _init_worker(*init)
        results = map(_work, items)
        pool = None
    else:
        # fork: workers inherit the imported modules (spawn re-imports torch in each worker)
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        pool = mp.get_context(method).Pool(workers, initializer=_init_worker, initargs=init)
        results = pool.imap_unordered(_work, items, chunksize=4)
    try:
        for path, err, disagree in tqdm(results, total=len(items), desc="canonical cache",
                                        disable=None):
            if err is not None:
                report.add(BadInputError(path, *err))
            else:
                report.count("cached")
                if disagree:
                    report.count("laterality_disagreement")
    finally:
        report_logger.setLevel(old_level)
        if pool is not None:
            pool.close()
            pool.join()
    return report


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    cfg = _load_cfg(args)
    try:  # dataset registration lives in braixdet.data.datasets (imported lazily)
        from braixdet.data.datasets import register_from_cfg
    except ImportError as e:
        sys.exit(f"dataset registration unavailable: {e}")
    names = register_from_cfg(cfg)
    names = sorted(set(names.values() if isinstance(names, dict) else names))
    items = collect_items(names)
    i, n = args.shard
    todo = shard(items, i, n)
    params = PreprocessParams(tuple(cfg.INPUT.BRAIXDET.CANONICAL_SIZE),
                              float(cfg.INPUT.BRAIXDET.MASK_MARGIN),
                              int(cfg.INPUT.BRAIXDET.MASK_DOWNSAMPLE))
    cache_dir = default_cache_dir(cfg)
    logger.info("datasets %s: %d unique images, shard %d/%d -> %d; cache %s/%s", names,
                len(items), i, n, len(todo), cache_dir, params.key())
    t0 = time.time()
    report = run(todo, cache_dir, params, args.workers,
                 bool(cfg.INPUT.BRAIXDET.ALLOW_FOR_PROCESSING),
                 fmt=cfg.INPUT.BRAIXDET.CACHE_FORMAT)
    dt = time.time() - t0
    for e in report.errors:
        print(f"BAD {e['path']}: {e['reason']}" + (f" ({e['detail']})" if e["detail"] else ""))
    out = os.path.join(cache_dir, params.key(), f"prepare_report_shard{i}of{n}.json")
    report.save(out)
    print(report.summary())
    print(json.dumps({"images": len(todo), "bad": report.num_bad, "seconds": round(dt, 1),
                      "images_per_s": round(len(todo) / max(dt, 1e-9), 2), "report": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
