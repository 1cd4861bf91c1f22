#!/usr/bin/env python
"""Cost of one student-teacher SSL iteration vs a supervised one (target: <= 1.35x).

Both variants drive the production step trainers of braixdet/engine/trainers.py on in-memory
loaders (mapper-like dicts with random pixels), on the same student model and optimizer:

* supervised: ``BRAIxStepTrainer.run_step`` on batches of 2B fully annotated images (one
  forward/backward of 2B images + optimizer step);
* SSL: ``StudentTeacherStepTrainer.run_step`` with B full + B weak images: teacher inference on
  the B weak images, ``make_pseudo_targets``, student forward on B full + B pseudo-labelled weak
  images, one backward, optimizer step, ``ema_update``.

So both steps put 2B images through the student. The student's BN layers are in the configured
``SSL.BN_MODE`` (paper: frozen) in both variants, so the ratio isolates the SSL overhead. The
variants alternate (warm-up first) and medians over repeats are compared. Random init (the
weights do not change the cost much; the teacher's detections become pseudo-labels either way).
No GradCAM fusion (SSL.USE_CAM off): after the first 2 epochs of D_w that is the steady state.

    .venv/bin/python benchmarks/benchmark_ssl_iteration.py [--batch 2] [--size 256 128]
        [--repeats 7] [--config demo/BRAIxDet/braixdet.yaml] [--out table.md] [--profile]
"""
import argparse
import cProfile
import pstats
import tempfile

import _common as C
import torch
from detectron2.utils.events import EventStorage


def build(cfg):
    from braixdet.engine.trainers import (
        BRAIxDetTrainer,
        BRAIxStepTrainer,
        StudentTeacherStepTrainer,
    )
    from braixdet.ssl.ema import apply_bn_mode, build_teacher

    torch.manual_seed(0)
    model = BRAIxDetTrainer.build_model(cfg)
    optimizer = BRAIxDetTrainer.build_optimizer(cfg, model)
    teacher = build_teacher(model)
    model.train()
    apply_bn_mode(model, teacher, cfg.SSL.BN_MODE)
    return model, teacher, optimizer, BRAIxStepTrainer, StudentTeacherStepTrainer


def loaders(size, batch, n_batches=3):
    """(supervised 2B-full, SSL B-full, SSL B-weak) in-memory loaders. Weak labels alternate
    1/0: label 1 gets the teacher's top-1 box, label 0 trains as background (both go through
    the student)."""
    sup, full, weak = [], [], []
    for b in range(n_batches):
        s = 1000 * b
        sup.append([C.fake_input(size, True, 1, s + i, "sup") for i in range(2 * batch)])
        full.append([C.fake_input(size, True, 1, s + i, "full") for i in range(batch)])
        weak.append([C.fake_input(size, False, 1 - i % 2, s + 100 + i, "weak")
                     for i in range(batch)])
    return C.CyclingLoader(sup), C.CyclingLoader(full), C.CyclingLoader(weak)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="demo/BRAIxDet/braixdet.yaml", help="relative to configs/")
    ap.add_argument("--size", type=int, nargs=2, default=None, metavar=("H", "W"),
                    help="canonical size (default: the config's, demo 256 128)")
    ap.add_argument("--batch", type=int, default=2, help="B: SSL uses B full + B weak")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="the defaults (sized for 2 CPU cores)")
    ap.add_argument("--target", type=float, default=1.35)
    ap.add_argument("--profile", action="store_true", help="cProfile one SSL step (top 25)")
    ap.add_argument("--opts", nargs=argparse.REMAINDER, default=[], help="extra config opts")
    ap.add_argument("--out", default=None, help="also write the markdown report here")
    args = ap.parse_args()
    C.set_threads()

    with tempfile.TemporaryDirectory(prefix="braixdet_bench_ssl_") as tmp:
        opts = ["SSL.ENABLED", "True", "SOLVER.IMS_PER_BATCH", str(2 * args.batch)]
        if args.size:
            opts += C.size_opts(args.size)
        cfg = C.build_cfg(args.config, opts + list(args.opts), output_dir=tmp)
        size = tuple(cfg.INPUT.BRAIXDET.CANONICAL_SIZE)
        model, teacher, optimizer, Sup, SSL = build(cfg)
        sup_loader, full_loader, weak_loader = loaders(size, args.batch)
        sup = Sup(model, sup_loader, optimizer, seed=cfg.SEED)
        ssl = SSL(model, teacher, full_loader, weak_loader, optimizer, cfg, {}, 0)

        with EventStorage(0) as storage:
            def step(trainer):
                def fn():
                    trainer.iter = storage.iter
                    trainer.run_step()
                    storage.step()
                return fn

            times = C.interleaved({"sup": step(sup), "ssl": step(ssl)}, args.repeats,
                                  args.warmup)
            weak_used = storage.history("ssl/weak_images_with_targets").values()
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                step(ssl)()
                prof.disable()
                pstats.Stats(prof).sort_stats("cumulative").print_stats(25)

    t_sup, t_ssl = C.median(times["sup"]), C.median(times["ssl"])
    ratio = C.median(C.paired_ratios(times, "ssl", "sup"))
    used = [v for v, _ in weak_used]

    def row(name, t, r):
        return [name, C.ms(C.median(t)), C.ms(min(t)), "{} – {}".format(*map(C.ms, C.iqr(t))), r]

    rows = [
        row(f"supervised: {2 * args.batch} full images (BRAIxStepTrainer.run_step)",
            times["sup"], "1.00"),
        row(f"SSL: {args.batch} full + {args.batch} weak, teacher on {args.batch} "
            "(StudentTeacherStepTrainer.run_step)", times["ssl"],
            f"{ratio:.2f} (medians {t_ssl / t_sup:.2f}, mins "
            f"{min(times['ssl']) / min(times['sup']):.2f})"),
    ]
    text = (
        f"config `{args.config}`, canonical size {size[0]}x{size[1]}, B={args.batch}, "
        f"BN mode {cfg.SSL.BN_MODE}, {args.repeats} interleaved repeats after {args.warmup} "
        f"warm-up rounds; weak images with pseudo-targets per SSL step: "
        f"min {int(min(used))} / {args.batch}\n\n"
        + C.md_table(["step", "median ms", "min ms", "IQR ms",
                      "ratio (median of paired per-round ratios)"], rows)
        + f"\n\nSSL / supervised = **{ratio:.2f}** (target <= {args.target}): "
        + C.verdict(ratio, args.target)
    )
    C.emit("SSL iteration vs supervised iteration", text, args.out)


if __name__ == "__main__":
    main()
