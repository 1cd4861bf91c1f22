"""Reliability: SIGKILL + resume, NaN/inf stop, CPU multi-process training, crafted checkpoints,
read-only dataset folder. Tiny runs (128x64, batch 2, <= 8 iterations)."""
import json
import os
import pickle
import random
import re
import signal
import subprocess
import textwrap
import time
import types

import pytest
import torch
from _train_helpers import (
    CONFIGS,
    REPO,
    PickledCode,
    assert_state_equal,
    build_trainer,
    load_ckpt,
    popen_train_net,
    run_checked,
    run_gradcam,
    tiny_opts,
    train_net_cmd,
    tree_digest,
    weak_cam_json,
)
from detectron2.modeling import build_model

from braixdet.config import build_cfg, resolve_cfg
from braixdet.engine.checkpoint import AtomicCheckpointer
from braixdet.engine.hooks import TrainingTimeHook
from braixdet.ssl.ema import unwrap
from braixdet.utils.checkpoint import load_inference_weights

KILL_ITERS = 8
CAM_ITERS = 4  # the CAM-fusion -> teacher-only boundary falls inside the killed/resumed run


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # see test_train_stages.py; same arithmetic as the subprocesses
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def work(tmp_path_factory, synthetic_root):
    d = tmp_path_factory.mktemp("reliability")
    ns = types.SimpleNamespace(root=synthetic_root.root, dir=d, cache=d / "cache",
                               splits=str(d / "splits"))
    # digest of the (read-only) dataset folder before anything in this module ran
    ns.root_digest = tree_digest(ns.root)
    probe = build_cfg(CONFIGS["braixdet"], _opts(ns, d / "probe", "braixdet"))
    probe = resolve_cfg(probe)
    ns.weak_name = probe.DATASETS.TRAIN_WEAK[0]
    ns.cam = weak_cam_json(d / "cam.json", ns.weak_name)
    return ns


def _opts(work, out, stage="braixdet", **kw):
    extra = ["DATASETS.BRAIXDET.SPLIT_DIR", work.splits, *kw.pop("extra", ())]
    return tiny_opts(work.root, out, work.cache, stage=stage, extra=extra, **kw)


def _ssl_opts(work, out, **kw):
    return _opts(work, out, "braixdet", cam_json=work.cam, cam_iters=CAM_ITERS,
                 extra=["TEST.BRAIXDET.EVAL_STUDENT", "False", *kw.pop("extra", ())], **kw)


def _last_checkpoint(out):
    try:
        with open(os.path.join(out, "last_checkpoint")) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return -1
    m = re.fullmatch(r"model_(\d{7})\.pth", name)
    return int(m.group(1)) if m else KILL_ITERS


def _all_finite(state):
    return all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


# ------------------------------------------------------------------------------ kill + resume
@pytest.mark.parametrize("stage,seed", [("braixdet", 5), ("mvccl", 1)])
def test_sigkill_then_resume_matches_uninterrupted_run(work, stage, seed):
    """SIGKILL train_net.py at a seeded random point (after >= 1 checkpoint, possibly while one
    is being written), --resume to the end: weights identical to an uninterrupted run. Stage 2
    crosses the CAM-fusion -> teacher-only boundary (CAM_ITERS) inside the run."""
    rng = random.Random(seed)
    kill_after, delay = rng.randint(1, 4), rng.uniform(0.0, 0.5)

    def opts_for(out, **kw):
        if stage == "braixdet":
            return _ssl_opts(work, out, max_iter=KILL_ITERS, **kw)
        return _opts(work, out, "mvccl", max_iter=KILL_ITERS, extra=["DATASETS.TEST", "()"],
                     **kw)

    out = work.dir / f"killed_{stage}"
    opts = opts_for(out, ckpt_period=1)
    log_path = work.dir / f"killed_{stage}.log"

    proc = popen_train_net(stage, opts, log_path=log_path)
    try:
        deadline = time.monotonic() + 180
        while _last_checkpoint(out) < kill_after:
            assert proc.poll() is None, \
                f"train_net exited early ({proc.returncode}): " + log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.02)
        time.sleep(delay)  # somewhere inside a later iteration (or checkpoint write)
        assert proc.poll() is None, "the run finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    done = _last_checkpoint(out)
    assert kill_after <= done < KILL_ITERS - 1
    assert not (out / "model_final.pth").exists()

    carried = load_ckpt(out / f"model_{done:07d}.pth")["trainer"]["hooks"]["TrainingTimeHook"]
    log = run_checked(train_net_cmd(stage, opts, "--resume"))
    m = re.search(r"Starting training from iteration (\d+)", log)
    assert m and int(m.group(1)) == done + 1, log[-3000:]
    resumed = load_ckpt(out / "model_final.pth")
    assert resumed["iteration"] == KILL_ITERS - 1
    # the killed attempt's time up to its checkpoint is handed on for the stage's run time
    earlier = json.loads((out / TrainingTimeHook.EARLIER_ATTEMPTS).read_text())
    assert earlier == {"from_iteration": done + 1, **carried} and carried["cpu_seconds"] > 0
    total = resumed["trainer"]["hooks"]["TrainingTimeHook"]
    assert total["cpu_seconds"] > carried["cpu_seconds"] and total["seconds"] > carried["seconds"]

    ref = build_trainer(stage, opts_for(work.dir / f"straight_{stage}"))
    ref.train()
    assert_state_equal(unwrap(ref.model).state_dict(), resumed["model"], "student")
    if stage == "braixdet":
        assert_state_equal(ref.teacher.state_dict(), resumed["teacher"], "teacher")


# ------------------------------------------------------------------------------ NaN / inf
def test_nan_loss_stops_with_named_term_and_keeps_last_good_checkpoint(work):
    bad_iter = 3
    out = work.dir / "nan"
    t = build_trainer("braixdet", _ssl_opts(work, out, max_iter=6, ckpt_period=1))
    student = unwrap(t.model)
    real_forward = student.forward

    def forward(batched_inputs, *a, **k):  # the weak (pseudo-labelled) branch diverges
        out = real_forward(batched_inputs, *a, **k)
        if student.training and t.iter == bad_iter and \
                batched_inputs[0]["annotation_type"] == "weak":
            out = dict(out, loss_cls=out["loss_cls"] * float("nan"))
        return out

    student.forward = forward
    with pytest.raises(FloatingPointError) as e:
        t.train()
    msg = str(e.value)
    assert re.search(rf"iteration={bad_iter}\b", msg) and "weak_loss_cls=nan" in msg, msg
    assert not re.search(r"(?<!weak_)loss_cls=", msg), msg  # the supervised term was fine

    assert _last_checkpoint(out) == bad_iter - 1
    assert not (out / "model_final.pth").exists()
    # SOLVER.BRAIXDET.CHECKPOINTS_KEPT 1 (the default): older periodic checkpoints are deleted
    assert sorted(p.name for p in out.glob("model_*.pth")) == [f"model_{bad_iter - 1:07d}.pth"]
    fresh = build_model(t.cfg)
    teacher = build_model(t.cfg)
    extra = AtomicCheckpointer(fresh, str(out), teacher=teacher).resume_or_load("", resume=True)
    assert extra["iteration"] == bad_iter - 1
    assert _all_finite(fresh.state_dict()) and _all_finite(teacher.state_dict())
    # the NaN never reached the weights: the stopped trainer still holds the checkpointed ones
    assert_state_equal(fresh.state_dict(), student.state_dict(), "student after the NaN")
    assert_state_equal(teacher.state_dict(), t.teacher.state_dict(), "teacher after the NaN")


def test_diverging_lr_stops_stage1_with_iteration_and_term(work):
    out = work.dir / "diverge"
    t = build_trainer("mvccl", _opts(work, out, "mvccl", max_iter=8, ckpt_period=1,
                                     extra=["SOLVER.BASE_LR", "1e30", "SOLVER.WARMUP_ITERS", "0",
                                            "DATASETS.TEST", "()",
                                            "SOLVER.BRAIXDET.CHECKPOINTS_KEPT", "0"]))
    with pytest.raises(FloatingPointError) as e:
        t.train()
    msg = str(e.value)
    m = re.search(r"iteration=(\d+): (.*)", msg)
    assert m and re.search(r"loss_\w+=(nan|inf|-inf)", m.group(2)), msg
    bad_iter = int(m.group(1))
    assert bad_iter >= 1  # the first step ran with finite losses
    assert _last_checkpoint(out) == bad_iter - 1
    # CHECKPOINTS_KEPT 0 keeps every periodic checkpoint (detectron2's behaviour)
    assert sorted(p.name for p in out.glob("model_*.pth")) == [
        f"model_{i:07d}.pth" for i in range(bad_iter)]
    ckpt = load_ckpt(out / f"model_{bad_iter - 1:07d}.pth")
    assert _all_finite(ckpt["model"])
    fresh = build_model(t.cfg)
    AtomicCheckpointer(fresh).load(str(out / f"model_{bad_iter - 1:07d}.pth"))
    assert_state_equal(ckpt["model"], fresh.state_dict(), "reloaded")


# ------------------------------------------------------------------------------ multi-process
LAUNCHER = """
import json, os, sys
import torch
from braixdet.pipeline import train_net  # what tools/train_net.py runs
from detectron2.engine import default_argument_parser, launch
from detectron2.utils import comm
from braixdet.engine import trainer_class
from braixdet.ssl.ema import unwrap


def main(args, out):
    cfg = train_net.setup(args)
    trainer = trainer_class(cfg)(cfg)
    trainer.resume_or_load(resume=False)
    trainer.train()
    r = comm.get_rank()
    torch.save({{"teacher": trainer.teacher.state_dict(),
                "student": unwrap(trainer.model).state_dict(),
                "wrapper": type(trainer.model).__name__, "world": comm.get_world_size(),
                "lrs": [g["lr"] for g in trainer.optimizer.param_groups],
                "reductions": trainer.plateau.num_reductions,
                "exported": trainer.best_export.exported_iter,
                "last_eval": trainer.best_export.last_eval_iter}},
               os.path.join(out, "teacher_rank%d.pth" % r))
    with open(os.path.join(out, "results_rank%d.json" % r), "w") as f:
        json.dump(trainer._last_eval_results, f)


if __name__ == "__main__":
    out = sys.argv.pop(1)
    args = default_argument_parser().parse_args()
    launch(main, args.num_gpus, dist_url=args.dist_url, args=(args, out))
"""


def test_two_process_cpu_training_identical_teachers(work):
    """Two processes (DDP on CPU) train identical replicas. With periodic validation, gathered
    on rank 0, ReduceLROnPlateau and the best export must decide the same on every rank (an lr
    cut on one rank alone lets the replicas drift apart), and the export is scored on the test
    set by every rank or by none (a collective on one rank alone never returns)."""
    import json

    from detectron2.data import DatasetCatalog

    script = work.dir / "launch_ddp.py"
    script.write_text(textwrap.dedent(LAUNCHER.format(tools=os.path.join(REPO, "tools"))))
    res_dir = work.dir / "ddp_ranks"
    res_dir.mkdir()
    out = work.dir / "ddp"
    # patience 0: every evaluation that is not a new best cuts the lr
    opts = _ssl_opts(work, out, max_iter=6, eval_period=2,
                     extra=["SOLVER.BRAIXDET.PLATEAU_PATIENCE", "0"])
    cmd = train_net_cmd("braixdet", opts, "--num-gpus", "2", "--dist-url", "auto")
    cmd[1:2] = [str(script), str(res_dir)]  # same arguments, through the launcher
    run_checked(cmd, timeout=300)

    ranks = [torch.load(res_dir / f"teacher_rank{r}.pth", weights_only=True) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["wrapper"] == "DistributedDataParallel"
    assert_state_equal(ranks[0]["student"], ranks[1]["student"], "student rank0 vs rank1")
    assert_state_equal(ranks[0]["teacher"], ranks[1]["teacher"], "teacher rank0 vs rank1")
    assert _all_finite(ranks[0]["teacher"])
    # the teacher moved away from the student (EMA), identically on both ranks
    assert any(not torch.equal(v, ranks[0]["student"][k])
               for k, v in ranks[0]["teacher"].items() if v.is_floating_point())
    # the cases validation is here for: an lr cut, an export that is not the last evaluation
    assert ranks[0]["reductions"] >= 1 and ranks[0]["exported"] != ranks[0]["last_eval"]
    for key in ("reductions", "lrs", "exported", "last_eval"):
        assert ranks[0][key] == ranks[1][key], key

    # evaluation ran on both ranks, gathered on rank 0 which alone wrote the metrics
    res0 = json.loads((res_dir / "results_rank0.json").read_text())
    assert "AP20" in res0["cbis_ddsm_test"]["bbox"], res0  # the export's test score
    # ... and shared with rank 1, whose hooks read the same metrics
    assert json.loads((res_dir / "results_rank1.json").read_text()) == res0
    metrics = out / "inference" / "model" / "cbis_ddsm_test" / "metrics.json"
    n_test = json.loads(metrics.read_text())["num_images"]
    assert n_test == len(DatasetCatalog.get("cbis_ddsm_test")) > 1
    dets = json.loads((metrics.parent / "detections_coco.json").read_text())
    assert len({d["image_id"] for d in dets}) == n_test  # both ranks' halves were gathered
    assert (out / "model_final.pth").is_file()
    final = load_ckpt(out / "model_final.pth")
    assert_state_equal(final["teacher"], ranks[0]["teacher"], "checkpointed teacher")


# ------------------------------------------------------------------------------ crafted pickle
def test_crafted_checkpoint_is_refused(work):
    d = work.dir / "evil"
    d.mkdir()
    marker = d / "pwned"
    weights = d / "model_final.pth"
    torch.save({"model": {"w": torch.zeros(1)}, "payload": PickledCode(str(marker))}, weights)
    legacy = d / "legacy.pth"  # a plain (non-zip) pickle
    with open(legacy, "wb") as f:
        pickle.dump(PickledCode(str(marker)), f, protocol=2)

    opts = _opts(work, d / "out", "mvccl", extra=["MODEL.WEIGHTS", str(weights)])
    p = subprocess.run(train_net_cmd("mvccl", opts, "--eval-only"), cwd=REPO,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=240)
    log = p.stdout.decode(errors="replace")
    assert p.returncode != 0, log[-3000:]
    # the user gets one line naming the file and the reason; the traceback is in log.txt
    assert log.strip().splitlines()[-1] == (
        f"error: refusing to load {weights}: it contains Python objects other than tensors and "
        "plain values (weights_only)"), log[-3000:]
    log = (d / "out" / "log.txt").read_text()
    assert "Weights only load failed" in log or "UnpicklingError" in log, log[-3000:]
    assert not marker.exists()

    model = torch.nn.Linear(1, 1)
    for path in (weights, legacy):
        with pytest.raises(pickle.UnpicklingError):
            load_inference_weights(model, str(path))
        with pytest.raises(pickle.UnpicklingError):
            AtomicCheckpointer(model).load(str(path))
    assert not marker.exists()


# ------------------------------------------------------------------------------ read-only data
def test_dataset_folder_never_written(work):
    """Runs last in this module: stage-1 training and GradCAM pseudo-labels (this test) plus all
    the runs above left the dataset folder byte-for-byte unchanged."""
    out = work.dir / "s1"
    t = build_trainer("mvccl", _opts(work, out, "mvccl", max_iter=2,
                                     extra=["DATASETS.TEST", "('cbis_ddsm_val_s0',)"]))
    t.train()
    res = run_gradcam(work.root, work.dir / "gradcam_out", work.cache, out / "model_final.pth",
                      work.dir / "gradcam.json")
    from detectron2.data import DatasetCatalog

    malignant_weak = {str(d["image_id"]) for d in DatasetCatalog.get(work.weak_name)
                      if int(d["label"]) == 1}
    assert set(res["images"]) == malignant_weak
    assert not (work.dir / "gradcam.json.partial.jsonl").exists()
    assert tree_digest(work.root) == work.root_digest
    assert not any(str(p).startswith(os.path.abspath(work.root)) for p in
                   (t.cfg.OUTPUT_DIR, work.splits, work.cache))


# ------------------------------------------------------------------------------ GradCAM resume
def _gradcam_main(synthetic_root, tmp_path, out, extra=()):
    """tools/gradcam_pseudo_labels.py's main() (the package's entry point) in this process on
    random classifier weights."""
    from braixdet.pipeline import gradcam_pseudo_labels as tool
    from braixdet.utils.checkpoint import export_model_only

    opts = tiny_opts(synthetic_root.root, tmp_path / "o", tmp_path / "cache", stage="mvccl",
                     extra=["MODEL.BRAIXDET.PRETRAINED", "", "INPUT.BRAIXDET.MASK_DOWNSAMPLE",
                            "2", *extra])
    weights = tmp_path / "w.pth"
    if not weights.exists():
        torch.manual_seed(0)
        export_model_only(build_model(build_cfg(CONFIGS["mvccl"], opts)), str(weights))
    return tool.main(["--config-file", CONFIGS["mvccl"], "--weights", str(weights), "--out",
                      str(out), *opts])


def _plant_partial(out, fp, image_id):
    with open(str(out) + ".partial.jsonl", "w") as f:
        f.write(json.dumps({"fingerprint": fp}) + "\n")
        f.write(json.dumps({"image_id": image_id, "boxes": [[1, 2, 3, 4]], "scores": [0.5]})
                + "\n")


def test_gradcam_resume_only_with_the_same_preprocessing(synthetic_root, tmp_path):
    """Issue 21 item 4: a partial file written with another MASK_MARGIN / MASK_DOWNSAMPLE /
    CANONICAL_SIZE was merged ("resuming ...: N images already labelled")."""
    out = tmp_path / "cam.json"
    first = _gradcam_main(synthetic_root, tmp_path, out)
    fp, image_id = first["meta"]["fingerprint"], sorted(first["images"])[0]
    _plant_partial(out, fp, image_id)  # a killed run with the same settings: resumed
    assert _gradcam_main(synthetic_root, tmp_path, out)["images"][image_id]["boxes"] == \
        [[1, 2, 3, 4]]
    for extra in (["INPUT.BRAIXDET.MASK_MARGIN", "0.1"],
                  ["INPUT.BRAIXDET.MASK_DOWNSAMPLE", "4"]):
        _plant_partial(out, fp, image_id)
        res = _gradcam_main(synthetic_root, tmp_path, out, extra)
        assert res["images"][image_id]["boxes"] != [[1, 2, 3, 4]], extra
        assert res["meta"]["fingerprint"]["preprocess"] != fp["preprocess"]


def test_gradcam_outputs_never_follow_planted_symlinks(synthetic_root, tmp_path):
    """Issue 21 item 1 for tools/gradcam_pseudo_labels.py: a link at --out is replaced by the
    file, a link at its .partial.jsonl removed; neither target is written."""
    out = tmp_path / "cam.json"
    victim, dangling = tmp_path / "victim", tmp_path / "dangling"
    victim.write_text("keep")
    os.symlink(victim, out)
    os.symlink(dangling, str(out) + ".partial.jsonl")
    res = _gradcam_main(synthetic_root, tmp_path, out)
    assert victim.read_text() == "keep" and not dangling.exists()
    assert not out.is_symlink() and json.loads(out.read_text())["images"] == res["images"]
