#!/usr/bin/env python
"""Cost of one student-teacher SSL iteration vs a supervised one (target: <= 1.35x).

Both variants drive the production step trainers of braixdet/engine/trainers.py on in-memory
loaders (mapper-like dicts with random pixels, already on ``--device``), on the same student
model and optimizer:

* supervised: ``BRAIxStepTrainer.run_step`` on batches of 2B fully annotated images (one
  forward/backward of 2B images + optimizer step);
* SSL: ``StudentTeacherStepTrainer.run_step`` with B full + B weak images: teacher inference on
  the B weak images, ``make_pseudo_targets``, student forward on B full + B pseudo-labelled weak
  images, one backward, optimizer step, ``ema_update``.

So both steps put 2B images through the student. The student's BN layers are in the configured
``SSL.BN_MODE`` (paper: frozen) in both variants, so the ratio isolates the SSL overhead. The
variants alternate (warm-up first) and medians over repeats are compared; the device is
synchronised before every clock reading. Random init (the weights do not change the cost much;
the teacher's detections become pseudo-labels either way). No GradCAM fusion by default
(SSL.USE_CAM off: after the first 2 epochs of D_w that is the steady state); ``--cam`` adds
synthetic GradCAM boxes for every weak image and keeps the fusion phase on.

``--amp`` sets SOLVER.AMP.ENABLED True (the step trainers' autocast + gradient scaler where they
honour it; the report says whether autocast reached the model); ``--compare-amp`` runs fp32 and
AMP one after the other and prints them side by side (time ratio, peak memory of each).
``--profile`` times the CPU-side parts of the SSL step on their own (issue 13.4), device
synchronised around each: teacher inference, CAM box mapping (``cam_boxes_in_input_frame``),
pseudo-label building (``make_pseudo_targets``) and the EMA update (``ema_update``), as shares of
the step.

    .venv/bin/python benchmarks/benchmark_ssl_iteration.py [--batch 2] [--size 256 128]
        [--repeats 7] [--config demo/BRAIxDet/braixdet.yaml] [--device cuda] [--amp]
        [--compare-amp] [--grad-checkpointing] [--profile] [--cam] [--cprofile] [--out table.md]

Paper size on a GPU (issue #13 table: SSL step 4 full + 4 weak):

    python benchmarks/benchmark_ssl_iteration.py --device cuda --config BRAIxDet/braixdet.yaml \
        --size 1536 768 --batch 4 --compare-amp --profile
"""
import argparse
import contextlib
import cProfile
import gc
import pstats
import tempfile
import time

import _common as C
import torch
from detectron2.utils.events import EventStorage

# The trainers module's names the SSL step calls (patched by --profile to time them).
PROFILED = ("cam_boxes_in_input_frame", "make_pseudo_targets", "ema_update")
PHASE_LABELS = {
    "teacher.inference": "teacher inference on the B weak images (no_grad)",
    "cam_boxes_in_input_frame": "CAM box mapping to the input frame (`cam_boxes_in_input_frame`)",
    "make_pseudo_targets": "pseudo-label building (`make_pseudo_targets`)",
    "ema_update": "EMA update (`ema_update`, torch._foreach_*)",
}


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


def loaders(size, batch, device, n_batches=3):
    """(supervised 2B-full, SSL B-full, SSL B-weak) in-memory loaders on ``device``, and the
    weak images' ids. Weak labels alternate 1/0: label 1 gets the teacher's top-1 box, label 0
    trains as background (both go through the student)."""
    sup, full, weak = [], [], []
    for b in range(n_batches):
        s = 1000 * b
        sup.append([C.fake_input(size, True, 1, s + i, "sup") for i in range(2 * batch)])
        full.append([C.fake_input(size, True, 1, s + i, "full") for i in range(batch)])
        weak.append([C.fake_input(size, False, 1 - i % 2, s + 100 + i, "weak")
                     for i in range(batch)])
    weak_ids = [x["image_id"] for b in weak for x in b]
    sup, full, weak = (C.to_device(x, device) for x in (sup, full, weak))
    return C.CyclingLoader(sup), C.CyclingLoader(full), C.CyclingLoader(weak), weak_ids


def synthetic_cam_lookup(weak_ids, size, n_boxes=3):
    """GradCAM boxes (original pixels = canonical here: the fake inputs' transforms are empty)
    for every weak image, as ``load_cam_boxes`` returns them."""
    h, w = size
    g = torch.Generator().manual_seed(1)
    out = {}
    for i in weak_ids:
        c = 0.2 + 0.6 * torch.rand(n_boxes, 2, generator=g)
        half = torch.tensor([0.05 * w, 0.04 * h])
        xy = c * torch.tensor([w, h])
        out[str(i)] = {"boxes": torch.cat([xy - half, xy + half], 1).tolist(),
                       "scores": torch.rand(n_boxes, generator=g).tolist()}
    return out


@contextlib.contextmanager
def phase_timers(teacher, device):
    """Time the SSL step's parts (PROFILED + the teacher's inference), synchronising ``device``
    around each call; yields name -> seconds accumulated since the last ``clear()``."""
    import braixdet.engine.trainers as T

    acc = {}

    def wrap(name, fn):
        def timed(*a, **k):
            C.sync(device)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                C.sync(device)
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
        return timed

    originals = {n: getattr(T, n) for n in PROFILED if hasattr(T, n)}
    for n, f in originals.items():
        setattr(T, n, wrap(n, f))
    teacher.inference = wrap("teacher.inference", teacher.inference)
    try:
        yield acc
    finally:
        for n, f in originals.items():
            setattr(T, n, f)
        del teacher.inference  # the instance attribute; the class method is back


def run_precision(args, amp, tmp):
    """Build, time, measure and (optionally) profile one precision; returns its results."""
    opts = ["SSL.ENABLED", "True", "SOLVER.IMS_PER_BATCH", str(2 * args.batch),
            "DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH", str(args.batch)]
    opts += (C.device_opts(args.device) + C.amp_opts(amp)
             + C.grad_checkpointing_opts(args.grad_checkpointing))
    if args.size:
        opts += C.size_opts(args.size)
    if args.cam:
        opts += ["SSL.USE_CAM", "True"]
    cfg = C.build_cfg(args.config, opts + list(args.opts), output_dir=tmp)
    size = tuple(cfg.INPUT.BRAIXDET.CANONICAL_SIZE)
    model, teacher, optimizer, Sup, SSL = build(cfg)
    sup_loader, full_loader, weak_loader, weak_ids = loaders(size, args.batch, args.device)
    cam_lookup = synthetic_cam_lookup(weak_ids, size) if args.cam else {}
    fusion_iters = 10**9 if args.cam else 0
    from braixdet.engine.trainers import Precision

    precision = Precision.from_cfg(cfg)
    sup = Sup(model, sup_loader, optimizer, seed=cfg.SEED, precision=precision)
    ssl = SSL(model, teacher, full_loader, weak_loader, optimizer, cfg, cam_lookup, fusion_iters,
              precision)
    res = {"cfg": cfg, "size": size, "amp": amp}

    with EventStorage(0) as storage:
        def step(trainer):
            def fn():
                trainer.iter = storage.iter
                trainer.run_step()
                storage.step()
            return fn

        res["times"] = C.interleaved({"sup": step(sup), "ssl": step(ssl)}, args.repeats,
                                     args.warmup, args.device)
        res["dtype"] = C.autocast_seen(model, step(ssl))
        res["peak"] = {"sup": C.measure_peak(step(sup), args.device),
                       "ssl": C.measure_peak(step(ssl), args.device)}
        if args.profile:
            steps, phases = [], []
            with phase_timers(teacher, args.device) as acc:
                for _ in range(args.profile_steps):
                    acc.clear()
                    steps.append(C.timeit(step(ssl), args.device))
                    phases.append(dict(acc))
            res["profile"] = (steps, phases)
        if args.cprofile:
            prof = cProfile.Profile()
            prof.enable()
            step(ssl)()
            C.sync(args.device)
            prof.disable()
            print(f"### cProfile of one SSL step ({C.precision_name(amp, args.device)})")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
        res["weak_used"] = [v for v, _ in storage.history("ssl/weak_images_with_targets")
                            .values()]
    del model, teacher, optimizer, sup, ssl
    gc.collect()
    if C.is_cuda(args.device):
        torch.cuda.empty_cache()
    return res


def profile_table(res, device):
    steps, phases = res["profile"]
    names = [n for n in PHASE_LABELS if any(n in p for p in phases)]
    rows = []
    for n in names:
        t = [p.get(n, 0.0) for p in phases]
        share = C.median([a / b for a, b in zip(t, steps)])
        rows.append([PHASE_LABELS[n], C.ms(C.median(t)), f"{100 * share:.1f}%"])
    rest = [s - sum(p.get(n, 0.0) for n in names) for s, p in zip(steps, phases)]
    rows.append(["rest: student forward/backward on B full + B weak, optimizer step",
                 C.ms(C.median(rest)),
                 f"{100 * C.median([r / s for r, s in zip(rest, steps)]):.1f}%"])
    cpu_side = [sum(p.get(n, 0.0) for n in PROFILED) for p in phases]
    rows.append(["**pseudo-labels + CAM mapping + EMA** (the CPU-side work of issue 13.4)",
                 C.ms(C.median(cpu_side)),
                 f"**{100 * C.median([c / s for c, s in zip(cpu_side, steps)]):.1f}%**"])
    rows.append(["whole SSL step (instrumented)", C.ms(C.median(steps)), "100%"])
    return (f"### SSL step breakdown ({C.precision_name(res['amp'], device)}, {len(steps)} steps, "
            "device synchronised before and after each part)\n\n"
            + C.md_table(["part", "median ms", "share of the step (median)"], rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="demo/BRAIxDet/braixdet.yaml", help="relative to configs/")
    ap.add_argument("--size", type=int, nargs=2, default=None, metavar=("H", "W"),
                    help="canonical size (default: the config's, demo 256 128; paper 1536 768)")
    ap.add_argument("--batch", type=int, default=2,
                    help="B: SSL uses B full + B weak, supervised 2B full (paper: 4)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="the defaults (sized for 2 CPU cores)")
    ap.add_argument("--target", type=float, default=1.35)
    C.add_device_args(ap, what=C.AMP_TRAINING)
    C.add_grad_checkpointing_arg(ap)
    ap.add_argument("--profile", action="store_true",
                    help="time teacher inference, CAM mapping, pseudo-labels and EMA as shares "
                         "of the SSL step")
    ap.add_argument("--profile-steps", type=int, default=5, help="SSL steps timed by --profile")
    ap.add_argument("--cam", action="store_true",
                    help="GradCAM fusion phase on (synthetic CAM boxes for every weak image)")
    ap.add_argument("--cprofile", action="store_true", help="cProfile one SSL step (top 25)")
    args = C.parse_args(ap)

    with tempfile.TemporaryDirectory(prefix="braixdet_bench_ssl_") as tmp:
        results = [run_precision(args, amp, tmp) for amp in C.precisions(args)]

    cfg, size = results[0]["cfg"], results[0]["size"]
    rows, sections, ratios = [], [], {}
    for res in results:
        times, peak, name = res["times"], res["peak"], C.precision_name(res["amp"], args.device)
        t_sup, t_ssl = C.median(times["sup"]), C.median(times["ssl"])
        ratio = ratios[res["amp"]] = C.median(C.paired_ratios(times, "ssl", "sup"))

        def row(label, t, r, p, name=name):
            return [label, name, C.ms(C.median(t)), C.ms(min(t)),
                    "{} – {}".format(*map(C.ms, C.iqr(t))), C.gib(p), r]

        rows.append(row(f"supervised: {2 * args.batch} full images (BRAIxStepTrainer.run_step)",
                        times["sup"], "1.00", peak["sup"]))
        rows.append(row(f"SSL: {args.batch} full + {args.batch} weak, teacher on {args.batch} "
                        "(StudentTeacherStepTrainer.run_step)", times["ssl"],
                        f"{ratio:.2f} (medians {t_ssl / t_sup:.2f}, mins "
                        f"{min(times['ssl']) / min(times['sup']):.2f})", peak["ssl"]))
        if "profile" in res:
            sections.append(profile_table(res, args.device))

    used = [u for res in results for u in res["weak_used"]]
    amp_lines = "; ".join(f"{C.precision_name(r['amp'], args.device)}: "
                          f"{C.amp_status(r['amp'], r['dtype'])}" for r in results)
    text = (
        f"config `{args.config}`, canonical size {size[0]}x{size[1]}, B={args.batch}, "
        f"BN mode {cfg.SSL.BN_MODE}, GradCAM fusion {'on (synthetic boxes)' if args.cam else 'off'}"
        f", grad checkpointing {'on' if args.grad_checkpointing else 'off'}, {args.repeats} "
        f"interleaved repeats after {args.warmup} warm-up rounds; weak images with "
        f"pseudo-targets per SSL step: min {int(min(used))} / {args.batch}\n\n"
        f"precision: {amp_lines}\n\n"
        + C.md_table(["step", "precision", "median ms", "min ms", "IQR ms", "peak GiB",
                      "ratio (median of paired per-round ratios)"], rows)
        + f"\n\n{C.memory_note(args.device)}\n\n"
        + "\n".join(f"SSL / supervised ({C.precision_name(a, args.device)}) = **{r:.2f}** "
                    f"(target <= {args.target}): {C.verdict(r, args.target)}"
                    for a, r in ratios.items())
    )
    if len(results) == 2:
        fp, amp = results
        side = []
        for k, label in (("sup", f"supervised ({2 * args.batch} full)"),
                         ("ssl", f"SSL ({args.batch} full + {args.batch} weak)")):
            a, b = C.median(fp["times"][k]), C.median(amp["times"][k])
            side.append([label, C.ms(a), C.ms(b), f"{a / b:.2f}x", C.gib(fp["peak"][k]),
                         C.gib(amp["peak"][k])])
        text += ("\n\n### fp32 vs " + C.precision_name(True, args.device)
                 + " (run one after the other)\n\n"
                 + C.md_table(["step", "fp32 median ms", "AMP median ms", "speed-up fp32/AMP",
                               "fp32 peak GiB", "AMP peak GiB"], side))
    if sections:
        text += "\n\n" + "\n\n".join(sections)
    C.emit("SSL iteration vs supervised iteration", text, args)


if __name__ == "__main__":
    main()
