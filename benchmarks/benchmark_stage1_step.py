#!/usr/bin/env python
"""Stage-1 training step: the BRAIxMVCCL classifier (paper batch 8), time and peak memory.

One ``BRAIxStepTrainer.run_step`` of configs/MVCCL/mvccl.yaml's MVCCLClassifier (efficientnet_b0
shared by both views, LCM + GCM, BCE + consistency loss, Adam) on an in-memory loader of
(main, aux, label) inputs with random pixels, already on ``--device``: forward of B two-view
inputs (2B encoder images), backward, optimizer step. Random init (MODEL.BRAIXDET.PRETRAINED "":
the cost does not depend on the weights). Steps are timed after a warm-up with the device
synchronised before every clock reading; peak memory over one more step.

``--amp`` sets SOLVER.AMP.ENABLED True (the step trainer's autocast + gradient scaler where it
honours it; the report says whether autocast reached the model); ``--compare-amp`` runs fp32 and
AMP one after the other and prints them side by side; ``--grad-checkpointing`` sets
MODEL.BRAIXDET.GRAD_CHECKPOINTING True (timm's set_grad_checkpointing on the encoder).

    .venv/bin/python benchmarks/benchmark_stage1_step.py [--size 256 128] [--batch 8]
        [--repeats 5] [--device cuda] [--amp] [--compare-amp] [--grad-checkpointing]
        [--out table.md]

Paper size on a GPU (issue #13 table: stage-1 step, batch 8):

    python benchmarks/benchmark_stage1_step.py --device cuda --size 1536 768 --batch 8 \
        --compare-amp
"""
import argparse
import gc
import tempfile

import _common as C
import torch
from detectron2.utils.events import EventStorage


def run_precision(args, amp, tmp):
    from braixdet.engine.trainers import BRAIxStepTrainer, MVCCLTrainer, Precision

    opts = (C.size_opts(args.size) + ["SOLVER.IMS_PER_BATCH", str(args.batch)]
            + C.device_opts(args.device) + C.amp_opts(amp)
            + C.grad_checkpointing_opts(args.grad_checkpointing) + list(args.opts))
    cfg = C.build_cfg(args.config, opts, output_dir=tmp)
    torch.manual_seed(0)
    model = MVCCLTrainer.build_model(cfg)
    optimizer = MVCCLTrainer.build_optimizer(cfg, model)
    model.train()
    batches = []
    for b in range(3):
        batches.append([C.fake_input(args.size, False, (i + b) % 2, 1000 * b + i, "cls")
                        for i in range(args.batch)])
    loader = C.CyclingLoader(C.to_device(batches, args.device))
    trainer = BRAIxStepTrainer(model, loader, optimizer, seed=cfg.SEED,
                               precision=Precision.from_cfg(cfg))
    res = {"amp": amp, "cfg": cfg}
    with EventStorage(0) as storage:
        def step(trainer=trainer):
            trainer.iter = storage.iter
            trainer.run_step()
            storage.step()

        res["times"] = C.interleaved({"step": step}, args.repeats, args.warmup,
                                     args.device)["step"]
        res["dtype"] = C.autocast_seen(model, step)
        res["peak"] = C.measure_peak(step, args.device)
    res["params"] = sum(p.numel() for p in model.parameters()) / 1e6
    del model, optimizer, trainer, loader
    gc.collect()
    if C.is_cuda(args.device):
        torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="MVCCL/mvccl.yaml", help="relative to configs/")
    ap.add_argument("--size", type=int, nargs=2, default=[256, 128], metavar=("H", "W"),
                    help="canonical size (paper: 1536 768)")
    ap.add_argument("--batch", type=int, default=8, help="two-view inputs per step (paper: 8)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="the defaults (sized for 2 CPU cores)")
    C.add_device_args(ap, what=C.AMP_TRAINING)
    C.add_grad_checkpointing_arg(ap)
    args = C.parse_args(ap)
    args.size = tuple(args.size)

    with tempfile.TemporaryDirectory(prefix="braixdet_bench_stage1_") as tmp:
        results = [run_precision(args, amp, tmp) for amp in C.precisions(args)]

    rows = []
    for r in results:
        t = r["times"]
        rows.append([C.precision_name(r["amp"], args.device), C.ms(C.median(t)), C.ms(min(t)),
                     "{} – {}".format(*map(C.ms, C.iqr(t))),
                     C.ms(C.median(t) / args.batch), f"{args.batch / C.median(t):.2f}",
                     C.gib(r["peak"])])
    cfg = results[0]["cfg"]
    h, w = args.size
    text = (
        f"config `{args.config}` ({cfg.MODEL.META_ARCHITECTURE}, "
        f"{cfg.MODEL.BRAIXDET.TIMM_MODEL}, {results[0]['params']:.2f}M parameters, LCM "
        f"{cfg.MODEL.BRAIXDET.LCM.EMBED_DIM}/{cfg.MODEL.BRAIXDET.LCM.OUT_DIM}, GCM "
        f"{'on' if cfg.MODEL.BRAIXDET.GCM.ENABLED else 'off'}, "
        f"{cfg.SOLVER.BRAIXDET.OPTIMIZER}), random init, input {h}x{w}, batch {args.batch} "
        f"two-view inputs ({2 * args.batch} encoder images), grad checkpointing "
        f"{'on' if args.grad_checkpointing else 'off'}; {args.repeats} timed steps after "
        f"{args.warmup} warm-up steps\n\n"
        "precision: " + "; ".join(f"{C.precision_name(r['amp'], args.device)}: "
                                  f"{C.amp_status(r['amp'], r['dtype'])}" for r in results)
        + "\n\n"
        + C.md_table(["precision", "median ms/step", "min ms", "IQR ms", "ms/input",
                      "inputs/s", "peak GiB"], rows)
        + f"\n\n{C.memory_note(args.device)}"
    )
    if len(results) == 2:
        a, b = C.median(results[0]["times"]), C.median(results[1]["times"])
        text += (f"\n\nfp32 / {C.precision_name(True, args.device)} step time = **{a / b:.2f}x** "
                 f"(run one after the other); peak GiB fp32 {C.gib(results[0]['peak'])}, AMP "
                 f"{C.gib(results[1]['peak'])}")
    C.emit("Stage-1 classifier training step (BRAIxMVCCL)", text, args)


if __name__ == "__main__":
    main()
