"""tools/prepare_dataset.py through its main() on the session's synthetic CBIS-DDSM dataset:
complete, sharded, resumable, and exactly the entries the training mapper reads."""
import json
import logging
import os

import numpy as np
import pytest
from _train_helpers import REPO, tree_digest
from detectron2.data import DatasetCatalog

from braixdet.config import build_cfg, register_datasets, resolve_cfg
from braixdet.data.cache import CanonicalCache
from braixdet.data.mapper import MultiViewDatasetMapper, default_cache_dir
from braixdet.data.preprocess import PreprocessParams

CONFIG = os.path.join(REPO, "configs", "BRAIxDet", "braixdet.yaml")  # the README's command
TINY = ["INPUT.BRAIXDET.CANONICAL_SIZE", "(128, 64)", "INPUT.BRAIXDET.MASK_DOWNSAMPLE", "2"]


@pytest.fixture(scope="module")
def tool(load_tool):
    return load_tool("prepare_dataset")


def _opts(root, out, cache_dir=None):
    opts = ["DATASETS.BRAIXDET.ROOT", root, "OUTPUT_DIR", str(out / "run"),
            "DATASETS.BRAIXDET.SPLIT_DIR", str(out / "splits")] + TINY
    return opts + (["INPUT.BRAIXDET.CACHE_DIR", str(cache_dir)] if cache_dir else [])


def _main(tool, capsys, argv):
    assert tool.main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _entries(cache_root):
    """{relative path: mtime_ns} of every cache entry file (the tool's reports excluded)."""
    out = {}
    for dirpath, _, files in os.walk(cache_root):
        for f in files:
            if not f.startswith("prepare_report"):
                p = os.path.join(dirpath, f)
                out[os.path.relpath(p, cache_root)] = os.stat(p).st_mtime_ns
    return out


def test_prepare_dataset_sharded_resumable_and_read_by_the_mapper(tool, synthetic_root, tmp_path,
                                                                  capsys):
    root = synthetic_root.root
    before = tree_digest(root)
    log_level = logging.getLogger("braixdet").level
    out_a, cache_a = tmp_path / "a", tmp_path / "cache_a"

    # 1. one machine, everything: every main + aux image of every registered split is cached
    s = _main(tool, capsys, ["--config-file", CONFIG, "--workers", "1"]
              + _opts(root, out_a, cache_a))
    assert s["bad"] == 0 and s["already_cached"] == 0 and s["computed"] == s["images"] > 0
    cfg = build_cfg(CONFIG, _opts(root, out_a, cache_a))
    cfg = resolve_cfg(cfg)
    names = register_datasets(cfg)
    params = PreprocessParams.from_cfg(cfg)
    fmt = cfg.INPUT.BRAIXDET.CACHE_FORMAT
    cache = CanonicalCache(cache_a, params, fmt=fmt)
    files = set()
    for name in set(names.values()):
        for d in DatasetCatalog.get(name):
            for f in (d["file_name"], d.get("aux_file_name") or d["file_name"]):
                stem = cache.entry_path(f, d.get("laterality"))
                assert os.path.exists(stem + ".json") and os.path.exists(f"{stem}.{fmt}"), f
                files.add(os.path.abspath(f))
    assert len(files) == s["images"]
    full = _entries(os.path.join(cache_a, params.key()))
    assert len(full) == 2 * s["images"]  # image + JSON sidecar per file

    # 2. two shards (one with a worker pool), default cache dir = the mapper's: same entries
    out_b = tmp_path / "b"
    shard0 = _main(tool, capsys, ["--config-file", CONFIG, "--workers", "2", "--shard", "0/2"]
                   + _opts(root, out_b))
    cache_b = os.path.join(default_cache_dir(build_cfg(CONFIG, _opts(root, out_b))), params.key())
    assert shard0["cache"] == cache_b
    after0 = _entries(cache_b)
    shard1 = _main(tool, capsys, ["--config-file", CONFIG, "--workers", "1", "--shard", "1/2"]
                   + _opts(root, out_b))
    after1 = _entries(cache_b)
    assert shard0["computed"] + shard1["computed"] == s["images"]
    assert shard0["computed"] and shard1["computed"]
    assert {k: after1[k] for k in after0} == after0  # shard 1 recomputed nothing of shard 0's
    assert set(after1) == set(full)

    # 3. a re-run computes nothing: all hits, no entry rewritten
    again = _main(tool, capsys, ["--config-file", CONFIG, "--workers", "2"]
                  + _opts(root, out_a, cache_a))
    assert again["already_cached"] == again["images"] == s["images"] and again["computed"] == 0
    assert _entries(os.path.join(cache_a, params.key())) == full
    # ... and so does the --format/--root form with the same parameters
    alt = _main(tool, capsys, ["--format", "cbis_ddsm", "--root", root, "--size", "128", "64",
                               "--cache-dir", str(cache_a), "--workers", "1",
                               "INPUT.BRAIXDET.MASK_DOWNSAMPLE", "2", "OUTPUT_DIR",
                               str(out_a / "run"), "DATASETS.BRAIXDET.SPLIT_DIR",
                               str(out_a / "splits")])
    assert alt["already_cached"] == s["images"] and alt["computed"] == 0

    # 4. the training mapper reads exactly these entries (and recomputes none)
    mapper = MultiViewDatasetMapper(cfg, is_train=False)
    dicts = DatasetCatalog.get(names["test"])
    d = next(x for x in dicts if x.get("aux_file_name") not in (None, x["file_name"]))
    out = mapper(d)
    for key, f in (("image", d["file_name"]), ("aux_image", d["aux_file_name"])):
        img, _ = cache.get(f, d["laterality"])
        assert np.array_equal(out[key][0].numpy(), img)
        stem = cache.entry_path(f, d["laterality"])
        if fmt == "npy":
            q = np.load(f"{stem}.npy", allow_pickle=False)
            assert q.dtype == np.uint16 and np.abs(out[key][0].numpy() - q / 65535.0).max() < 1e-6
    assert _entries(os.path.join(cache_a, params.key())) == full

    assert tree_digest(root) == before  # the dataset folder is never written
    assert logging.getLogger("braixdet").level == log_level  # no leak into the caller


def test_prepare_dataset_refuses_a_cache_inside_the_dataset_root(tool, synthetic_root,
                                                                 tmp_path, capsys):
    root = synthetic_root.root
    before = tree_digest(root)
    inside = os.path.join(root, "cache")
    assert tool.main(["--format", "cbis_ddsm", "--root", root, "--cache-dir", inside,
                      "OUTPUT_DIR", str(tmp_path / "run")]) == 2
    assert "inside the dataset root" in capsys.readouterr().err
    assert tree_digest(root) == before


def test_prepare_dataset_arguments(tool):
    with pytest.raises(SystemExit):
        tool.parse_args(["--workers", "2"])  # no config file and no --format
    with pytest.raises(SystemExit):
        tool.parse_args(["--format", "cbis_ddsm", "--root", "/x", "--shard", "2/2"])
    assert tool.parse_args(["--config-file", "c.yaml", "--shard", "1/4"]).shard == (1, 4)
