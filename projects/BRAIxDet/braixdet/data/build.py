"""Deterministic, resumable multi-view data loaders (two training streams + test).

A training stream is a function of (seed, global draw index k): epoch = k // n picks a seeded
permutation, position = k % n the image, and k seeds the augmentation. Rank r of W takes draws
``start + r + W*j``, so global batch i is draws [start + i*B, start + (i+1)*B) for any W and
``start = start_iter * B``: resuming at iteration s reproduces exactly the batches a run started
at 0 would have produced at iteration s, without replaying the first s batches.
"""
import functools
import itertools
import logging
import random

import numpy as np
import torch
import torch.utils.data as torchdata
from detectron2.data import DatasetCatalog
from detectron2.data.build import trivial_batch_collator
from detectron2.data.samplers import InferenceSampler
from detectron2.utils import comm

from .mapper import MultiViewDatasetMapper
from .register import register_from_cfg

logger = logging.getLogger(__name__)

__all__ = ["DrawDataset", "DrawSampler", "build_multiview_train_loader",
           "build_two_stream_loaders", "build_multiview_test_loader", "get_dicts"]


def get_dicts(names):
    """Concatenated dataset dicts of registered names (weak dicts have no "annotations", so
    detectron2's get_detection_dataset_dicts histogram would fail on mixed lists)."""
    if isinstance(names, str):
        names = [names]
    dicts = list(itertools.chain.from_iterable(DatasetCatalog.get(n) for n in names))
    if not dicts:
        raise ValueError(f"datasets {list(names)} are empty")
    return dicts


class DrawDataset(torchdata.Dataset):
    """Global draw index k -> mapped dict of image perm_epoch[k % n] (with "_draw" = k).

    When the mapper returns None (unreadable file), the next positions of the same permutation
    are tried in order: deterministic, so a resumed run makes the same substitution.
    """

    def __init__(self, dicts, mapper, seed):
        self.dicts, self.mapper, self.seed = list(dicts), mapper, int(seed)
        if not self.dicts:
            raise ValueError("DrawDataset needs at least one dataset dict")
        self._perm = (None, None)  # (epoch, permutation) cache, one per worker process

    def __len__(self):
        return len(self.dicts)

    def permutation(self, epoch):
        if self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, int(epoch)]).permutation(
                len(self.dicts)))
        return self._perm[1]

    def index_of(self, k):
        """Dataset index drawn at global draw k (before any bad-file fallback)."""
        n = len(self.dicts)
        return int(self.permutation(k // n)[k % n])

    def __getitem__(self, k):
        k = int(k)
        n = len(self.dicts)
        perm = self.permutation(k // n)
        for step in range(n):
            d = dict(self.dicts[int(perm[(k + step) % n])])
            d["_draw"] = k
            out = self.mapper(d)
            if out is not None:
                return out
            if step == 0:
                logger.warning("draw %d: %s unusable, taking the next image of the epoch", k,
                               d.get("image_id"))
        raise RuntimeError("no image of the dataset could be loaded (see the warnings)")


class DrawSampler(torchdata.Sampler):
    """Infinite draw indices ``start + rank + world * j``, j = 0, 1, 2, ..."""

    def __init__(self, start=0, rank=None, world_size=None):
        self.start = int(start)
        self.rank = comm.get_rank() if rank is None else int(rank)
        self.world = comm.get_world_size() if world_size is None else int(world_size)

    def __iter__(self):
        return itertools.count(self.start + self.rank, self.world)


def _worker_init(seed, worker_id):
    # the data do not depend on these RNGs (draw-seeded); seeding only makes any stray use of
    # random/np.random/torch inside a worker reproducible
    s = (int(seed) * 1000 + comm.get_rank() * 64 + worker_id) % (2**31)
    np.random.seed(s)
    torch.manual_seed(s)
    random.seed(s)


def build_multiview_train_loader(cfg, dataset_names, total_batch_size, seed, start_iter=0,
                                 mapper=None, num_workers=None):
    """Infinite deterministic loader yielding lists of mapped dicts (per-rank batch).

    Global batch i (over all ranks) = draws [(start_iter + i) * B, (start_iter + i + 1) * B).
    """
    world = comm.get_world_size()
    total_batch_size = int(total_batch_size)
    if total_batch_size <= 0 or total_batch_size % world:
        raise ValueError(f"total batch size {total_batch_size} must be a positive multiple of "
                         f"the world size {world}")
    dicts = get_dicts(dataset_names)
    mapper = mapper if mapper is not None else MultiViewDatasetMapper(cfg, True)
    dataset = DrawDataset(dicts, mapper, seed)
    sampler = DrawSampler(int(start_iter) * total_batch_size)
    workers = cfg.DATALOADER.NUM_WORKERS if num_workers is None else int(num_workers)
    init = functools.partial(_worker_init, seed) if workers else None
    return torchdata.DataLoader(
        dataset, batch_size=total_batch_size // world, sampler=sampler, num_workers=workers,
        collate_fn=trivial_batch_collator, worker_init_fn=init,
        drop_last=True,
    )


def train_seed(cfg):
    """The one base seed of training streams and per-iteration reseeding (SEED < 0: 0)."""
    return max(int(cfg.SEED), 0)


def two_stream_names(cfg, full_names=None, weak_names=None):
    """(D_s names, D_w names): DATASETS.TRAIN and DATASETS.TRAIN_WEAK, an empty one filled from
    the protocol (register_from_cfg)."""
    full_names = list(full_names or cfg.DATASETS.TRAIN)
    weak_names = list(weak_names or cfg.DATASETS.TRAIN_WEAK)
    if not weak_names or not full_names:
        names = register_from_cfg(cfg)
        full_names = full_names or [names["train_full"]]
        weak_names = weak_names or [names["train_weak"]]
    return full_names, weak_names


def build_stream_loader(cfg, stream, names, start_iter=0, mapper=None):
    """The SSL stage's ``stream`` loader: "full" = D_s with SOLVER.IMS_PER_BATCH and seed
    train_seed(cfg), "weak" = D_w with DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH and seed + 1."""
    if stream not in ("full", "weak"):
        raise ValueError(f"stream must be full or weak, got {stream!r}")
    weak = stream == "weak"
    batch = cfg.DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH if weak else cfg.SOLVER.IMS_PER_BATCH
    return build_multiview_train_loader(cfg, names, batch, train_seed(cfg) + int(weak),
                                        start_iter, mapper)


def build_two_stream_loaders(cfg, start_iter=0, full_names=None, weak_names=None, mapper=None):
    """(full_loader, weak_loader) for the SSL stage (see build_stream_loader)."""
    full_names, weak_names = two_stream_names(cfg, full_names, weak_names)
    return (build_stream_loader(cfg, "full", full_names, start_iter, mapper),
            build_stream_loader(cfg, "weak", weak_names, start_iter, mapper))


class _TestDataset(torchdata.IterableDataset):
    """This rank's share of the dataset (InferenceSampler order), split among workers; an
    unreadable image is skipped (logged by the mapper) instead of replaced by another one, so
    no image is evaluated twice."""

    def __init__(self, dicts, mapper):
        self.dicts, self.mapper = dicts, mapper
        self.indices = list(InferenceSampler(len(dicts)))

    def __iter__(self):
        info = torchdata.get_worker_info()
        idx = self.indices if info is None else self.indices[info.id::info.num_workers]
        for i in idx:
            out = self.mapper(dict(self.dicts[i]))
            if out is not None:
                yield out

    def __len__(self):
        return len(self.indices)


def build_multiview_test_loader(cfg, dataset_name, mapper=None, num_workers=None):
    """Batch-1 inference loader over one registered dataset (or a list of dicts)."""
    dicts = dataset_name if isinstance(dataset_name, list) else get_dicts(dataset_name)
    mapper = mapper if mapper is not None else MultiViewDatasetMapper(cfg, False)
    workers = cfg.DATALOADER.NUM_WORKERS if num_workers is None else int(num_workers)
    return torchdata.DataLoader(_TestDataset(dicts, mapper), batch_size=1, num_workers=workers,
                                collate_fn=trivial_batch_collator)
