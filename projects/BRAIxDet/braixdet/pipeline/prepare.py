"""Fill the canonical-image cache of a dataset ahead of training (tools/prepare_dataset.py).

Uses the training code path end to end: the datasets are registered by
``config.register_datasets`` (same split JSON and bad-input report in ``SPLIT_DIR``), and
entries are written by the mapper's ``CanonicalCache`` at ``default_cache_dir(cfg)`` with
``PreprocessParams.from_cfg(cfg)``, so training finds every entry. Every main and auxiliary
image of every registered split is processed once (sorted unique list; ``shard`` i/N takes
every N-th file from i); files the cache already holds are skipped; bad files are counted and
listed one line each, never stopping the run; the dataset folder is only read.
"""
import logging
import multiprocessing as mp
import os
import time

from detectron2.data import DatasetCatalog
from tqdm import tqdm

from ..config import build_cfg, register_datasets
from ..data.cache import CanonicalCache
from ..data.datasets.common import is_under
from ..data.mapper import default_cache_dir
from ..data.preprocess import PreprocessParams
from ..data.report import BadInputError, BadInputReport

logger = logging.getLogger("braixdet.prepare")


def build_prepare_cfg(config_file, root="", fmt="", csv="", size=None,
                      cache_dir="", allow_for_processing=False, opts=()):
    """The training config (build_cfg) with the tool's flags as overrides; ``opts`` last."""
    flags = []
    for key, value in (("DATASETS.BRAIXDET.FORMAT", fmt), ("DATASETS.BRAIXDET.ROOT", root),
                       ("DATASETS.BRAIXDET.CSV", csv), ("INPUT.BRAIXDET.CACHE_DIR", cache_dir),
                       ("INPUT.BRAIXDET.CANONICAL_SIZE", str(tuple(size)) if size else "")):
        if value:
            flags += [key, value]
    if allow_for_processing:
        flags += ["INPUT.BRAIXDET.ALLOW_FOR_PROCESSING", "True"]
    return build_cfg(config_file, flags + list(opts))


def collect_items(dataset_names):
    """Sorted unique (file_name, laterality) of main and aux images of the datasets.

    The laterality is the dict's, as the mapper passes it for both views (aux is ipsilateral).
    """
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


def split_cached(items, cache):
    """(items without a complete cache entry, number with one): CanonicalCache.has."""
    todo = [item for item in items if not cache.has(*item)]
    return todo, len(items) - len(todo)


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
    names = sorted(set(register_datasets(cfg).values()))
    fmt = cfg.INPUT.BRAIXDET.CACHE_FORMAT
    allow = bool(cfg.INPUT.BRAIXDET.ALLOW_FOR_PROCESSING)

    items = collect_items(names)
    mine = shard(items, shard_index, num_shards)
    todo, done = split_cached(mine, CanonicalCache(cache_dir, params, allow_for_processing=allow,
                                                   fmt=fmt))
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


