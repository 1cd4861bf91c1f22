#!/usr/bin/env python
"""DataLoader cost vs a training iteration at the demo size (target: data_time < 10%).

1. Writes a small synthetic CBIS-DDSM-layout dataset (synthetic_mammo) to a temporary
   folder and registers it with configs/demo/BRAIxDet/braixdet.yaml (split dir and canonical
   cache in the temporary folder too).
2. Cold vs warm load of one image: ``CanonicalCache.get`` on an empty cache (DICOM decode +
   canonicalisation + 16-bit PNG write; the DICOMs are in the OS page cache, just written) vs on
   the filled cache; plus one warm ``MultiViewDatasetMapper`` call (main + aux + augmentation).
3. Training with the real loader (``build_multiview_train_loader`` on DATASETS.TRAIN, demo batch)
   and the real step (``BRAIxStepTrainer.run_step``: forward + backward + Adam step of the
   MultiViewRCNN inside an EventStorage), for DATALOADER.NUM_WORKERS as configured and 1 worker.
   data_time = time of ``next(loader)`` inside the step, iteration = the whole step. The loader
   variants alternate in blocks of ``--block`` steps; the first ``--settle`` steps of a block are
   not counted (a worker loader prefetches while the other variant runs, which would hide its
   cost). The model runs on ``--device`` (the batches stay on the CPU, as the real loader yields
   them: the model's host->device copy is part of the iteration); the device is synchronised
   before every clock reading. ``--amp`` sets SOLVER.AMP.ENABLED True (a shorter GPU step makes
   the loader's share larger); ``--grad-checkpointing`` sets MODEL.BRAIXDET.GRAD_CHECKPOINTING.

    .venv/bin/python benchmarks/benchmark_dataloader.py [--patients 12] [--orig 512 320]
        [--size 256 128] [--batch 4] [--rounds 3] [--block 4] [--device cuda] [--amp]
        [--out table.md]
"""
import argparse
import os
import tempfile
import time

import _common as C
import torch
from detectron2.utils.events import EventStorage


class TimedIter:
    """Wraps an iterator; records the duration of every ``next``."""

    def __init__(self, it):
        self.it, self.times = iter(it), []

    def __iter__(self):
        return self

    def __next__(self):
        t = time.perf_counter()
        x = next(self.it)
        self.times.append(time.perf_counter() - t)
        return x


def setup(tmp, args):
    from braixdet.config import resolve_cfg

    root = os.path.join(tmp, "data")
    t = time.perf_counter()
    C.make_dataset(root, patients=args.patients, image_size=tuple(args.orig))
    t_gen = time.perf_counter() - t
    opts = ["DATASETS.BRAIXDET.ROOT", root, "DATASETS.BRAIXDET.SPLIT_DIR",
            os.path.join(tmp, "splits"), "INPUT.BRAIXDET.CACHE_DIR", os.path.join(tmp, "cache"),
            "SSL.ENABLED", "False"]
    if args.size:
        opts += C.size_opts(args.size)
    if args.batch:
        opts += ["SOLVER.IMS_PER_BATCH", str(args.batch)]
    opts += (C.device_opts(args.device) + C.amp_opts(args.amp)
             + C.grad_checkpointing_opts(args.grad_checkpointing))
    cfg = C.build_cfg(args.config, opts + list(args.opts), output_dir=os.path.join(tmp, "out"))
    return resolve_cfg(cfg), t_gen


def cold_warm(cfg, repeats, device):
    """Per-image cache miss vs hit over every train image (full + weak), then warm mapper calls
    on the training dicts (``device`` synchronised around each, as every timing). Leaves the
    cache warm."""
    from braixdet.data.build import get_dicts
    from braixdet.data.mapper import MultiViewDatasetMapper

    names = list(cfg.DATASETS.TRAIN) + list(cfg.DATASETS.TRAIN_WEAK)
    dicts = get_dicts(names)
    mapper = MultiViewDatasetMapper(cfg, True)
    files = {}
    for d in dicts:
        files[d["file_name"]] = d.get("laterality")
        files.setdefault(d.get("aux_file_name") or d["file_name"], d.get("laterality"))
    cold = [C.timeit(lambda f=f, lat=lat: mapper.cache.get(f, lat), device)
            for f, lat in files.items()]
    warm = []
    for _ in range(repeats):
        warm += [C.timeit(lambda f=f, lat=lat: mapper.cache.get(f, lat), device)
                 for f, lat in files.items()]
    train = get_dicts(cfg.DATASETS.TRAIN)
    mapped = [C.timeit(lambda d=d, k=k: mapper(dict(d, _draw=k)), device)
              for k, d in enumerate(train * max(1, repeats))]
    return {"images": len(files), "dicts": len(dicts), "train": len(train), "cold": cold,
            "warm": warm, "mapper": mapped}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="demo/BRAIxDet/braixdet.yaml", help="relative to configs/")
    ap.add_argument("--patients", type=int, default=12)
    ap.add_argument("--orig", type=int, nargs=2, default=[512, 320], metavar=("H", "W"),
                    help="size of the synthetic original mammograms")
    ap.add_argument("--size", type=int, nargs=2, default=None, metavar=("H", "W"),
                    help="canonical size (default: the config's, demo 256 128)")
    ap.add_argument("--batch", type=int, default=None, help="default: SOLVER.IMS_PER_BATCH (4)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of blocks")
    ap.add_argument("--block", type=int, default=4, help="steps per variant per round")
    ap.add_argument("--settle", type=int, default=2, help="uncounted steps at a block's start")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    ap.add_argument("--quick", action="store_true", help="the defaults (sized for 2 CPU cores)")
    ap.add_argument("--target", type=float, default=0.10)
    C.add_device_args(ap, amp=False)
    ap.add_argument("--amp", action="store_true", help=f"mixed precision: {C.AMP_TRAINING}")
    C.add_grad_checkpointing_arg(ap)
    args = C.parse_args(ap)

    from braixdet.data.build import build_multiview_train_loader
    from braixdet.engine.trainers import BRAIxDetTrainer, BRAIxStepTrainer, Precision

    with tempfile.TemporaryDirectory(prefix="braixdet_bench_data_") as tmp:
        cfg, t_gen = setup(tmp, args)
        cw = cold_warm(cfg, 3, args.device)

        torch.manual_seed(0)
        model = BRAIxDetTrainer.build_model(cfg)
        optimizer = BRAIxDetTrainer.build_optimizer(cfg, model)
        model.train()
        batch = cfg.SOLVER.IMS_PER_BATCH
        workers = [cfg.DATALOADER.NUM_WORKERS] + ([1] if cfg.DATALOADER.NUM_WORKERS != 1 else [])
        variants = {}
        for w in workers:
            loader = build_multiview_train_loader(cfg, cfg.DATASETS.TRAIN, batch, seed=0,
                                                  num_workers=w)
            it = TimedIter(loader)
            trainer = BRAIxStepTrainer(model, it, optimizer, seed=0,
                                       precision=Precision.from_cfg(cfg))
            variants[w] = {"it": it, "trainer": trainer, "data": [], "iter": []}

        with EventStorage(0) as storage:
            def steps(v, n, record):
                for _ in range(n):
                    v["trainer"].iter = storage.iter
                    dt = C.timeit(v["trainer"].run_step, args.device)
                    storage.step()
                    if record:
                        v["data"].append(v["it"].times[-1])
                        v["iter"].append(dt)

            for v in variants.values():
                steps(v, args.warmup, False)
            for r in range(args.rounds):
                order = list(variants.values())
                order = order[r % len(order):] + order[:r % len(order)]
                for v in order:
                    steps(v, args.settle, False)
                    steps(v, max(1, args.block - args.settle), True)
            for v in variants.values():
                v["peak"] = C.measure_peak(lambda v=v: steps(v, 1, False), args.device)
            dtype = C.autocast_seen(model, lambda: steps(next(iter(variants.values())), 1, False))
        for v in variants.values():  # shut the worker processes down
            del v["trainer"], v["it"]

    rows = []
    ratios = {}
    for w, v in variants.items():
        d, it = C.median(v["data"]), C.median(v["iter"])
        # ratio per step, then the median: robust to a slow step of either part
        ratio = C.median([a / b for a, b in zip(v["data"], v["iter"])])
        ratios[w] = ratio
        tag = " (config)" if w == cfg.DATALOADER.NUM_WORKERS else ""
        rows.append([f"{w}{tag}", len(v["data"]), C.ms(d), C.ms(it), C.ms(it - d),
                     C.gib(v["peak"]), f"{100 * ratio:.1f}%", C.verdict(ratio, args.target)])
    size = tuple(cfg.INPUT.BRAIXDET.CANONICAL_SIZE)
    load_rows = [
        ["cold: `CanonicalCache.get`, cache miss (decode + canonicalise + cache write)",
         len(cw["cold"]), C.ms(C.median(cw["cold"])), C.ms(max(cw["cold"]))],
        ["warm: `CanonicalCache.get`, cache hit (npy + JSON read)", len(cw["warm"]),
         C.ms(C.median(cw["warm"])), C.ms(max(cw["warm"]))],
        ["warm: `MultiViewDatasetMapper` (train) per dict, main + aux + aug", len(cw["mapper"]),
         C.ms(C.median(cw["mapper"])), C.ms(max(cw["mapper"]))],
    ]
    cold, warm = C.median(cw["cold"]), C.median(cw["warm"])
    text = (
        f"config `{args.config}`; synthetic dataset: {args.patients} patients, originals "
        f"{args.orig[0]}x{args.orig[1]} (generated in {t_gen:.1f} s), {cw['images']} train "
        f"images, DATASETS.TRAIN = {list(cfg.DATASETS.TRAIN)} ({cw['train']} dicts); canonical "
        f"{size[0]}x{size[1]}, batch {batch}; {args.rounds} alternating rounds x "
        f"{max(1, args.block - args.settle)} counted steps per loader after {args.warmup} "
        f"warm-up steps; precision: {C.amp_status(args.amp, dtype)}\n\n"
        "### Per-image load\n\n"
        + C.md_table(["load", "n", "median ms", "max ms"], load_rows)
        + f"\n\ncold / warm = {cold / warm:.1f}x\n\n"
        "### data_time vs training iteration (MultiViewRCNN, BRAIxStepTrainer.run_step)\n\n"
        + C.md_table(["workers", "steps", "data_time ms", "iteration ms", "compute ms",
                      "peak GiB", "data / iteration", f"target < {100 * args.target:.0f}%"], rows)
        + f"\n\n{C.memory_note(args.device)}"
    )
    C.emit("DataLoader: data_time vs training iteration", text, args)


if __name__ == "__main__":
    main()
