#!/usr/bin/env python
"""Fill the canonical-image cache of a BRAIxDet dataset ahead of training.

Examples:
  python tools/prepare_dataset.py --config-file configs/BRAIxDet/braixdet.yaml --workers 16 \\
      --shard 0/4 DATASETS.BRAIXDET.ROOT /data/CBIS-DDSM
  python tools/prepare_dataset.py --format cbis_ddsm --root /data/CBIS-DDSM \\
      --cache-dir /scratch/cache --size 1536 768 --shard 1/4

Uses the training code path end to end: the config is built by ``engine.setup.build_cfg``, the
datasets are registered by ``register_and_assign_datasets`` (same split JSON and bad-input report
in ``SPLIT_DIR``), and entries are written by the mapper's ``CanonicalCache`` at the mapper's
``default_cache_dir(cfg)`` with ``PreprocessParams.from_cfg(cfg)``, so training finds every entry.

Every main and auxiliary image of every registered split (all five roles) is processed once:
sorted unique file list, ``--shard i/N`` takes every N-th file from i, so N machines split the
work. Resumable: files whose cache entry already exists are skipped, so a re-run (or a run after
a crash) only processes what is missing. Bad files are counted and listed one line each; the tool
never stops on one. The dataset folder is only read.
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
from braixdet.data.datasets.common import is_under
from braixdet.data.mapper import default_cache_dir
from braixdet.data.preprocess import PreprocessParams
from braixdet.data.report import BadInputError, BadInputReport
from braixdet.engine.setup import build_cfg, register_and_assign_datasets

logger = logging.getLogger("prepare_dataset")


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


def build_prepare_cfg(args):
    """The training config (build_cfg) with this tool's flags as overrides; ``opts`` last."""
    flags = []
    if args.format:
        flags += ["DATASETS.BRAIXDET.FORMAT", args.format]
    if args.root:
        flags += ["DATASETS.BRAIXDET.ROOT", args.root]
    if args.csv:
        flags += ["DATASETS.BRAIXDET.CSV", args.csv]
    if args.size:
        flags += ["INPUT.BRAIXDET.CANONICAL_SIZE", str(tuple(args.size))]
    if args.cache_dir:
        flags += ["INPUT.BRAIXDET.CACHE_DIR", args.cache_dir]
    if args.allow_for_processing:
        flags += ["INPUT.BRAIXDET.ALLOW_FOR_PROCESSING", "True"]
    return build_cfg(args.config_file, flags + list(args.opts))


def collect_items(dataset_names):
    """Sorted unique (file_name, laterality) of main and aux images of the datasets.

    The laterality is the dict's, as the mapper passes it for both views (aux is ipsilateral).
    """
    from detectron2.data import DatasetCatalog

    items = {}
    for name in dataset_names:
        for d in DatasetCatalog.get(name):
            lat = d.get("laterality")
            for key in ("file_name", "aux_file_name"):
                f = d.get(key)
                if f:
                    items.setdefault(os.path.abspath(f), lat)
    return sorted(items.items())


def shard(items, i, n):
    return items[i::n]


def split_cached(items, cache, fmt):
    """(items without a complete cache entry, number with one). An entry is complete when its
    image and its JSON sidecar (written last) exist; the cache validates it when it is read."""
    todo, done = [], 0
    for path, lat in items:
        try:
            stem = cache.entry_path(path, lat)
        except OSError:  # missing/unreadable file: the worker reports it as a bad input
            todo.append((path, lat))
            continue
        if os.path.exists(stem + ".json") and os.path.exists(f"{stem}.{fmt}"):
            done += 1
        else:
            todo.append((path, lat))
    return todo, done


_CACHE = None


def _init_worker(cache_dir, params, allow_for_processing, fmt="npy", pool_worker=True):
    global _CACHE
    if pool_worker:
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


def _start_pool(workers, init):
    """Worker processes, forked (they inherit the imported modules; spawn would re-import torch
    in each). OpenCV's thread pool is not fork-safe: a child forked while the parent's pool
    threads exist hangs in its first cv2 call (the dataset loaders use cv2), so the parent's
    pool is shut down (setNumThreads(1) joins its threads) while forking, then restored."""
    import cv2

    if "fork" not in mp.get_all_start_methods():
        return mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=init)
    old = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        return mp.get_context("fork").Pool(workers, initializer=_init_worker, initargs=init)
    finally:
        cv2.setNumThreads(old)


def run(items, cache_dir, params, workers=1, allow_for_processing=False, report=None,
        fmt="npy"):
    """Compute the cache entries of ``items`` [(path, laterality)]; returns the BadInputReport
    (``counts["cached"]``: entries written by this call)."""
    report = report or BadInputReport("prepare_dataset")
    # Bad files are listed after the progress bar instead of interleaved with it.
    # (_init_worker quietens "braixdet" in the process it runs in: restored below when in-process)
    loggers = [logging.getLogger("braixdet.data.report"), logging.getLogger("braixdet")]
    old_levels = [lg.level for lg in loggers]
    loggers[0].setLevel(logging.ERROR)
    init = (cache_dir, params, allow_for_processing, fmt)
    pool = None
    if workers <= 1 or len(items) <= 1:
        _init_worker(*init, pool_worker=False)
        results = map(_work, items)
    else:
        pool = _start_pool(min(workers, len(items)), init)
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
        for lg, level in zip(loggers, old_levels):
            lg.setLevel(level)
        if pool is not None:
            pool.close()
            pool.join()
    return report


def prepare(cfg, shard_index=0, num_shards=1, workers=1):
    """Register the configured dataset, then cache this shard's missing entries.

    Returns a summary dict (also what ``main`` prints as its last line).
    """
    if not cfg.DATASETS.BRAIXDET.ROOT:
        raise ValueError("no dataset: set DATASETS.BRAIXDET.ROOT (or --root)")
    root = cfg.DATASETS.BRAIXDET.ROOT
    params = PreprocessParams.from_cfg(cfg)
    cache_dir = default_cache_dir(cfg)  # where the training mapper looks
    if is_under(cache_dir, root):
        raise ValueError(f"cache dir {cache_dir} is inside the dataset root {root} (read only)")
    names = sorted(set(register_and_assign_datasets(cfg).values()))
    fmt = cfg.INPUT.BRAIXDET.CACHE_FORMAT
    allow = bool(cfg.INPUT.BRAIXDET.ALLOW_FOR_PROCESSING)

    items = collect_items(names)
    mine = shard(items, shard_index, num_shards)
    todo, done = split_cached(mine, CanonicalCache(cache_dir, params, allow_for_processing=allow,
                                                   fmt=fmt), fmt)
    logger.info("datasets %s: %d unique images; shard %d/%d: %d, %d already cached, %d to "
                "process; cache %s", names, len(items), shard_index, num_shards, len(mine),
                done, len(todo), os.path.join(cache_dir, params.key()))
    t0 = time.time()
    report = run(todo, cache_dir, params, workers, allow, fmt=fmt)
    dt = time.time() - t0
    report.count("already_cached", done)
    for e in report.errors:
        print(f"BAD {e['path']}: {e['reason']}" + (f" ({e['detail']})" if e["detail"] else ""))
    out = os.path.join(cache_dir, params.key(),
                       f"prepare_report_shard{shard_index}of{num_shards}.json")
    report.save(out)
    print(report.summary())
    computed = report.counts.get("cached", 0)
    return {"datasets": names, "images": len(mine), "already_cached": done,
            "computed": computed, "bad": report.num_bad, "seconds": round(dt, 1),
            "images_per_s": round(computed / max(dt, 1e-9), 2),
            "cache": os.path.join(cache_dir, params.key()), "report": out}


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    cfg = build_prepare_cfg(args)
    try:
        summary = prepare(cfg, *args.shard, workers=args.workers)
    except (ValueError, FileNotFoundError) as e:
        print(f"prepare_dataset: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
