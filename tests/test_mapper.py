"""MultiViewDatasetMapper outputs and the deterministic, resumable loaders."""
import itertools

import numpy as np
import pytest
import torch
from detectron2.config import get_cfg
from detectron2.data import DatasetCatalog
from detectron2.structures import Instances

from braixdet.config import add_braixdet_config
from braixdet.data.build import (
    DrawDataset,
    build_multiview_test_loader,
    build_multiview_train_loader,
    build_two_stream_loaders,
)
from braixdet.data.mapper import MultiViewDatasetMapper
from braixdet.data.register import register_braixdet_datasets

SIZE = (128, 64)


@pytest.fixture(scope="module")
def env(synthetic_root, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mapper")
    names = register_braixdet_datasets("exam_csv", synthetic_root.root, name="synthmap",
                                       protocol="partial", ratio="1/2", seed=0,
                                       split_dir=str(tmp / "splits"))
    cfg = add_braixdet_config(get_cfg())
    cfg.OUTPUT_DIR = str(tmp / "out")
    cfg.INPUT.BRAIXDET.CANONICAL_SIZE = SIZE
    cfg.INPUT.BRAIXDET.CACHE_DIR = str(tmp / "cache")
    cfg.DATALOADER.NUM_WORKERS = 0
    cfg.SOLVER.IMS_PER_BATCH = 2
    cfg.DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH = 3
    cfg.DATASETS.TRAIN = (names["train_full"],)
    cfg.DATASETS.TRAIN_WEAK = (names["train_weak"],)
    cfg.SEED = 7
    return cfg, names


def _mapper(cfg, is_train=True, **kw):
    args = MultiViewDatasetMapper.from_config(cfg, is_train)
    args.update(kw)
    return MultiViewDatasetMapper(**args)


def test_mapper_fields_and_boxes_roundtrip(env):
    cfg, names = env
    mapper = MultiViewDatasetMapper(cfg, False)  # configurable: (cfg, is_train)
    dicts = DatasetCatalog.get(names["train_all"]) + DatasetCatalog.get(names["test"])
    kinds = set()
    for d in dicts:
        out = mapper(dict(d))
        for k in ("image", "aux_image"):
            assert out[k].dtype == torch.float32 and tuple(out[k].shape) == (1, *SIZE)
            assert 0 <= out[k].min() and out[k].max() <= 1
        assert (out["label"], out["annotation_type"], out["image_id"]) == (
            d["label"], d["annotation_type"], d["image_id"])
        assert (out["height"], out["width"]) == (d["height"], d["width"])
        if d["annotation_type"] == "weak":
            assert "instances" not in out
            kinds.add("weak")
            continue
        inst = out["instances"]
        assert isinstance(inst, Instances) and inst.image_size == SIZE
        assert len(inst) == len(d["annotations"])
        assert inst.gt_classes.dtype == torch.int64 and (inst.gt_classes == 0).all()
        kinds.add(f"full{d['label']}")
        if len(inst):
            back = out["transforms"].inverse().apply_box(inst.gt_boxes.tensor.numpy())
            want = np.array([a["bbox"] for a in d["annotations"]])
            assert np.abs(back - want).max() <= 1.0
    assert kinds == {"weak", "full0", "full1"}  # label-0 full images have empty instances
    # an aux view differs from the main one when present
    d = next(d for d in dicts if not d["aux_missing"])
    out = mapper(dict(d))
    assert not torch.equal(out["image"], out["aux_image"])


def test_augmentation_reproducible(env):
    cfg, names = env
    d = next(x for x in DatasetCatalog.get(names["train_full"]) if x["label"] == 1)
    m = _mapper(cfg, True)
    a, b = m(dict(d, _draw=5)), m(dict(d, _draw=5))
    assert torch.equal(a["image"], b["image"]) and torch.equal(a["aux_image"], b["aux_image"])
    assert torch.equal(a["instances"].gt_boxes.tensor, b["instances"].gt_boxes.tensor)
    outs = [m(dict(d, _draw=k))["image"] for k in range(6)]
    assert any(not torch.equal(outs[0], o) for o in outs[1:])
    # vertical flip: both views and the boxes flip together; "transforms" excludes it
    plain = _mapper(cfg, False)(dict(d))
    flip = _mapper(cfg, True, vflip_prob=1.0, brightness=0.0, contrast=0.0)(dict(d, _draw=0))
    assert torch.allclose(flip["image"], plain["image"].flip(1))
    assert torch.allclose(flip["aux_image"], plain["aux_image"].flip(1))
    pb, fb = plain["instances"].gt_boxes.tensor, flip["instances"].gt_boxes.tensor
    assert torch.allclose(fb[:, 1], SIZE[0] - pb[:, 3]) and torch.allclose(fb[:, 0], pb[:, 0])
    assert repr(flip["transforms"]) == repr(plain["transforms"])
    assert np.allclose(flip["aug_transforms"].apply_box(pb.numpy()), fb.numpy())


def _batches(loader, n):
    return list(itertools.islice(iter(loader), n))


def _same(b1, b2):
    assert [x["image_id"] for x in b1] == [x["image_id"] for x in b2]
    for x, y in zip(b1, b2):
        assert torch.equal(x["image"], y["image"]) and torch.equal(x["aux_image"],
                                                                 y["aux_image"])


def test_train_loader_resume(env):
    cfg, names = env
    full = [names["train_all"]]
    ref = _batches(build_multiview_train_loader(cfg, full, 3, seed=4), 12)
    n = len(DatasetCatalog.get(names["train_all"]))
    assert all(len(b) == 3 for b in ref)
    # every epoch visits each image once
    ids = [x["image_id"] for b in ref for x in b]
    assert len(set(ids[:n])) == n
    resumed = _batches(build_multiview_train_loader(cfg, full, 3, seed=4, start_iter=5), 4)
    for i, b in enumerate(resumed):
        _same(b, ref[5 + i])
    # workers do not change the data
    par = _batches(build_multiview_train_loader(cfg, full, 3, seed=4, start_iter=5,
                                                num_workers=2), 2)
    _same(par[0], ref[5])
    _same(par[1], ref[6])
    other = _batches(build_multiview_train_loader(cfg, full, 3, seed=5), 3)
    assert [x["image_id"] for b in other for x in b] != ids[:9]


def test_draw_dataset_bad_file_fallback(env):
    cfg, names = env
    dicts = DatasetCatalog.get(names["train_all"])
    mapper = _mapper(cfg, True)
    bad = dicts[0]["image_id"]
    ds = DrawDataset(dicts, lambda d: None if d["image_id"] == bad else mapper(d), seed=1)
    k = next(k for k in range(len(dicts)) if ds.index_of(k) == 0)
    out = ds[k]
    n = len(dicts)
    nxt = int(ds.permutation(k // n)[(k + 1) % n])  # next position of the same permutation
    assert out["image_id"] == dicts[nxt]["image_id"] != bad
    assert ds[k]["image_id"] == out["image_id"]


def test_two_streams_and_test_loader(env):
    cfg, names = env
    full, weak = build_two_stream_loaders(cfg)
    fb, wb = next(iter(full)), next(iter(weak))
    assert len(fb) == 2 and len(wb) == 3
    assert all(x["annotation_type"] == "full" and "instances" in x for x in fb)
    assert all(x["annotation_type"] == "weak" and "instances" not in x for x in wb)
    test = build_multiview_test_loader(cfg, names["test"])
    seen = [b for b in test]
    assert all(len(b) == 1 for b in seen)
    assert sorted(b[0]["image_id"] for b in seen) == sorted(
        d["image_id"] for d in DatasetCatalog.get(names["test"]))
    assert all(not b[0]["aug_transforms"].transforms for b in seen)
