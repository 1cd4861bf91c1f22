"""Both training stages end to end on the tiny synthetic dataset (128x64, batch 2, <= 6 iters).

Stage 1 (BRAIxMVCCL) runs through tools/train_net.py; stage 2 (student-teacher BRAIxDet) and
the supervised baseline run in-process (build_cfg -> register -> Trainer), which is faster.
"""
import json
import logging
import math
import os
import types

import pytest
import torch
from _train_helpers import (
    assert_state_equal,
    build_trainer,
    classification_metrics,
    load_ckpt,
    run_train_net,
    tiny_opts,
    weak_cam_json,
)
from detectron2.checkpoint import DetectionCheckpointer
from detectron2.data import DatasetCatalog
from detectron2.engine.train_loop import HookBase
from detectron2.modeling import build_model

from braixdet.data.build import build_multiview_test_loader
from braixdet.ssl.ema import unwrap
from braixdet.utils.checkpoint import export_model_only

N_ITER = 6  # straight runs; resumed runs stop after 3 and continue to 6
HALF = 3
CAM_ITERS = 3  # GradCAM fusion during iterations 0..2, the teacher alone afterwards
ALPHA = 0.5  # SSL.EMA_ALPHA of tiny_opts
S1_TEST = ("cbis_ddsm_train_all_s0", "cbis_ddsm_test")  # train_all has both labels: finite AUC


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the machine is shared by several people: one intra-op thread is much faster than 2
    # oversubscribed ones, and gives the same arithmetic as the OMP_NUM_THREADS=1 subprocesses
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def work(tmp_path_factory, synthetic_root):
    d = tmp_path_factory.mktemp("train_stages")
    return types.SimpleNamespace(root=synthetic_root.root, dir=d, cache=d / "cache",
                                 splits=str(d / "splits"))


def _opts(work, out, stage, **kw):
    extra = ["DATASETS.BRAIXDET.SPLIT_DIR", work.splits, *kw.pop("extra", ())]
    return tiny_opts(work.root, out, work.cache, stage=stage, extra=extra, **kw)


class StopAfter(HookBase):
    """Simulates an interruption right after iteration ``it`` (after its checkpoint)."""

    def __init__(self, it):
        self.it = it

    def after_step(self):
        if self.trainer.iter == self.it:
            raise KeyboardInterrupt(f"stop after iteration {self.it}")


def _interrupted_then_resumed(stage, opts):
    """HALF iterations of an N_ITER run, interruption, then a fresh trainer with resume."""
    t = build_trainer(stage, opts)
    t.register_hooks([StopAfter(HALF - 1)])
    with pytest.raises(KeyboardInterrupt):
        t.train()
    out = t.cfg.OUTPUT_DIR
    with open(os.path.join(out, "last_checkpoint")) as f:
        assert f.read().strip() == f"model_{HALF - 1:07d}.pth"
    assert not os.path.exists(os.path.join(out, "model_final.pth"))
    del t
    t = build_trainer(stage, opts, resume=True)
    assert t.start_iter == HALF
    t.train()
    return t


# ------------------------------------------------------------------------------ stage 1
@pytest.fixture(scope="module")
def stage1(work):
    """tools/train_net.py on BRAIxMVCCL: N_ITER iterations, final evaluation on S1_TEST."""
    out = work.dir / "mvccl"
    opts = _opts(work, out, "mvccl", max_iter=N_ITER, ckpt_period=HALF,
                 extra=["DATASETS.TEST", repr(S1_TEST)])
    run_train_net("mvccl", opts)
    return types.SimpleNamespace(out=out, opts=opts, ckpt=out / "model_final.pth")


def test_stage1_train_then_eval_only_reproduces_metrics(work, stage1):
    assert stage1.ckpt.is_file()
    ckpt = load_ckpt(stage1.ckpt)
    assert ckpt["iteration"] == N_ITER - 1
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())

    eval_out = work.dir / "mvccl_eval"
    opts = _opts(work, eval_out, "mvccl", extra=["DATASETS.TEST", repr(S1_TEST),
                                                 "MODEL.WEIGHTS", str(stage1.ckpt)])
    run_train_net("mvccl", opts, "--eval-only")
    for name in S1_TEST:
        trained = classification_metrics(stage1.out, name)
        again = classification_metrics(eval_out, name)
        assert trained["num_images"] == again["num_images"] > 0
        for key in ("AUC", "BCE", "ACC"):
            a, b = trained["classification"][key], again["classification"][key]
            if a is None:  # AUC of a single-class set (written as null)
                assert b is None, (name, key, b)
                continue
            assert b is not None and abs(a - b) <= 1e-6, (name, key, a, b)
    assert trained["classification"]["BCE"] is not None
    auc = classification_metrics(stage1.out, S1_TEST[0])["classification"]["AUC"]
    assert auc is not None and 0.0 <= auc <= 1.0  # both classes present in train_all


def test_stage1_exact_resume(work, stage1):
    """3 + resume + 3 in this process == 6 straight in the train_net.py subprocess."""
    opts = _opts(work, work.dir / "mvccl_resumed", "mvccl", max_iter=N_ITER, ckpt_period=HALF,
                 extra=["DATASETS.TEST", repr(S1_TEST[:1])])
    t = _interrupted_then_resumed("mvccl", opts)
    resumed = load_ckpt(os.path.join(t.cfg.OUTPUT_DIR, "model_final.pth"))
    straight = load_ckpt(stage1.ckpt)
    assert_state_equal(straight["model"], resumed["model"], "stage-1 weights")
    assert_state_equal(straight["model"], unwrap(t.model).state_dict(), "stage-1 in memory")


# ------------------------------------------------------------------------------ stage 2
class Recorder(HookBase):
    """Per-iteration SSL scalars, and the teacher/student weights around the last step."""

    def __init__(self):
        self.scalars = {}

    def before_step(self):
        if self.trainer.iter == self.trainer.max_iter - 1:
            self.teacher_before = _float_params(self.trainer.teacher)

    def after_step(self):
        st = self.trainer.storage
        self.scalars[self.trainer.iter] = {
            k: h.latest() for k, h in st.histories().items()
            if k.startswith(("weak_", "ssl/")) and st.latest()[k][1] == self.trainer.iter}


def _float_params(model):
    return {k: v.detach().clone() for k, v in unwrap(model).named_parameters()}


@pytest.fixture(scope="module")
def ssl_run(work, stage1):
    """BRAIxDet SSL in-process: N_ITER iterations from the stage-1 checkpoint, with a
    hand-written CAM JSON and CAM fusion during the first CAM_ITERS iterations, logging the
    pseudo-label quality (SSL.PSEUDO_QUALITY; the resumed run of test_stage2_ssl_exact_resume
    shows it changes no weight)."""
    from _train_helpers import CONFIGS

    from braixdet.config import build_cfg, resolve_cfg

    cam = work.dir / "cam.json"
    probe = build_cfg(CONFIGS["braixdet"], _opts(work, work.dir / "probe", "braixdet"))
    probe = resolve_cfg(probe)
    weak_cam_json(cam, probe.DATASETS.TRAIN_WEAK[0])

    opts = _opts(work, work.dir / "ssl", "braixdet", max_iter=N_ITER, ckpt_period=HALF,
                 init_from=stage1.ckpt, cam_json=cam, cam_iters=CAM_ITERS,
                 extra=["TEST.BRAIXDET.EVAL_STUDENT", "False"])
    t = build_trainer("braixdet", [*opts, "SSL.PSEUDO_QUALITY", "True"])
    init = {"teacher": {k: v.clone() for k, v in t.teacher.state_dict().items()},
            "student": {k: v.clone() for k, v in unwrap(t.model).state_dict().items()}}
    rec = Recorder()
    t.register_hooks([rec])
    t.train()
    return types.SimpleNamespace(trainer=t, rec=rec, init=init, opts=opts, cam=cam)


def test_cam_view_agreement_filters_the_boxes_stage2_reads(work, stage1):
    """SSL.CAM_VIEW_AGREEMENT: the trainer's CAM boxes are the filtered ones (every box at
    depth 0.5, every map firing only at the nipple: paired boxes go, unpaired ones stay)."""
    import json

    from _train_helpers import CONFIGS
    from detectron2.data import DatasetCatalog

    from braixdet.cam import view_agreement_filter
    from braixdet.config import build_cfg, resolve_cfg

    probe = build_cfg(CONFIGS["braixdet"], _opts(work, work.dir / "probe_va", "braixdet"))
    probe = resolve_cfg(probe)
    weak = probe.DATASETS.TRAIN_WEAK[0]
    cam = weak_cam_json(work.dir / "cam_va.json", weak)
    data = json.loads(cam.read_text())
    for rec in data["images"].values():
        rec.update(depths=[0.5], profile=[1.0] + [0.0] * 63)
    cam.write_text(json.dumps(data))
    lookups = {}
    for delta in (0.0, 0.1):
        opts = _opts(work, work.dir / f"va{delta}", "braixdet", max_iter=1,
                     init_from=stage1.ckpt, cam_json=cam,
                     extra=["SSL.CAM_VIEW_AGREEMENT", str(delta)])
        lookups[delta] = build_trainer("braixdet", opts)._trainer.cam_lookup
    assert lookups[0.0] == data["images"]
    expected, counts = view_agreement_filter(data["images"], DatasetCatalog.get(weak), 0.1, 0.5)
    assert lookups[0.1] == expected and counts["dropped"] > 0


def test_cam_box_sources_reach_algorithm2(work, stage1, synthetic_root, caplog, load_tool):
    """SSL.CAM_BOX_SOURCE: "oracle" fuses exactly the generator's true boxes of D_w's cancers,
    and against the truth (SSL.PSEUDO_QUALITY) they score precision = recall = 1 in the input
    frame; "gradcam" fuses the file's boxes only: neither they nor the weak batches the teacher
    labels carry a true box (the truth stays in the quality scalars' own lookup). Mean Teacher
    (SSL.USE_CAM False) fuses nothing, and its log says so rather than naming a fusion window;
    the fusing runs' line names the source and is the one experiment_box_sources.py parses."""
    from braixdet.ssl.box_sources import true_box_lookup
    from braixdet.ssl.pseudo_quality import match_counts

    probe = build_cfg_registered(work, "probe_src")
    cam = weak_cam_json(work.dir / "cam_src.json", probe.DATASETS.TRAIN_WEAK[0])
    truth = {os.path.join(synthetic_root.root, t["path"]):
             [les["bbox"] for les in t["lesions"] if les["malignant"]]
             for t in synthetic_root.summary["truth"]}
    steps, fusion_lines = {}, {}
    for source in ("oracle", "gradcam", "none"):
        extra = ["SSL.USE_CAM", "False"] if source == "none" else \
            ["SSL.CAM_BOX_SOURCE", source, "SSL.PSEUDO_QUALITY", "True"]
        opts = _opts(work, work.dir / f"src_{source}", "braixdet", max_iter=1,
                     init_from=stage1.ckpt, cam_json=cam if source == "gradcam" else "",
                     extra=extra)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="braixdet"):
            steps[source] = build_trainer("braixdet", opts)._trainer
        fusion_lines[source] = [r.getMessage() for r in caplog.records
                                if r.getMessage().startswith("Algorithm 2: ")]
    oracle, gradcam = steps["oracle"], steps["gradcam"]
    FUSION_LINE = load_tool("experiment_box_sources", folder="benchmarks").FUSION_LINE
    for source in ("oracle", "gradcam"):
        assert fusion_lines[source] == [f"Algorithm 2: {source} boxes fused during the first "
                                        f"{gradcam.fusion_iters} iterations"]
        assert FUSION_LINE.findall(fusion_lines[source][0]) == [str(gradcam.fusion_iters)]
    assert steps["none"].cam_lookup == {} and len(fusion_lines["none"]) == 1
    assert fusion_lines["none"][0].startswith("Algorithm 2: off (no boxes to fuse: SSL.USE_CAM "
                                              "False"), fusion_lines["none"]
    weak = DatasetCatalog.get(probe.DATASETS.TRAIN_WEAK[0])
    cancers = {str(d["image_id"]): d["file_name"] for d in weak if d["label"] == 1}
    assert {k: v["boxes"] for k, v in oracle.cam_lookup.items()} == \
        {k: truth[f] for k, f in cancers.items()}
    assert gradcam.cam_lookup == json.loads(cam.read_text())["images"]
    assert gradcam.truth_lookup == oracle.truth_lookup == true_box_lookup(weak)
    for image_id, entry in gradcam.cam_lookup.items():
        assert match_counts(entry["boxes"], truth[cancers[image_id]], iou_thresh=0.99)[0] == 0
    for _ in range(8):  # weak batches until one holds a weak cancer
        batch = next(gradcam._weak_iter)
        assert not any("instances" in x or "withheld_annotations" in x for x in batch)
        oracle.pseudo_targets(batch)
        s = oracle.quality.scalars()
        if "ssl/quality/cam_recall" in s:
            break
    assert s["ssl/quality/cam_precision"] == s["ssl/quality/cam_recall"] == 1.0, s


def build_cfg_registered(work, name):
    from _train_helpers import CONFIGS

    from braixdet.config import build_cfg, resolve_cfg

    cfg = build_cfg(CONFIGS["braixdet"], _opts(work, work.dir / name, "braixdet"))
    cfg = resolve_cfg(cfg)
    return cfg


def test_stage2_init_from_classifier(ssl_run, stage1):
    cls = load_ckpt(stage1.ckpt)["model"]
    enc = [k for k in cls if k.startswith("bottom_up.encoder.") and cls[k].is_floating_point()]
    assert enc
    for k in enc:
        assert torch.equal(ssl_run.init["student"]["backbone." + k], cls[k]), k
    assert_state_equal(ssl_run.init["student"], ssl_run.init["teacher"], "teacher at start")


def test_stage2_ssl_weak_losses_and_cam_phase(ssl_run):
    rec = ssl_run.rec.scalars
    assert sorted(rec) == list(range(N_ITER))
    for it, scalars in rec.items():
        weak = {k: v for k, v in scalars.items() if k.startswith("weak_loss_")}
        assert {"weak_loss_cls", "weak_loss_box_reg", "weak_loss_rpn_cls"} <= set(weak), it
        assert all(math.isfinite(v) for v in weak.values()), (it, weak)
        assert scalars["ssl/weak_images_with_targets"] > 0, it
        assert scalars["ssl/cam_fusion"] == float(it < CAM_ITERS), (it, scalars)
    # top-1 pseudo-labels: the teacher's best box on every malignant weak image
    assert sum(s["ssl/pseudo_boxes"] for s in rec.values()) > 0


def test_stage2_pseudo_quality_scalars(ssl_run):
    """SSL.PSEUDO_QUALITY: precision/recall per source in EventStorage, in [0, 1]. No hand-written
    CAM box (each image's central quarter) covers a lesion at IoU >= 0.2 (checked in original
    pixels; IoU does not change under the shared crop/flip/resize), so the CAM source's precision
    and recall are exactly 0."""
    from detectron2.data import DatasetCatalog

    from braixdet.ssl.box_sources import true_box_lookup
    from braixdet.ssl.pseudo_quality import match_counts

    rec = ssl_run.rec.scalars
    keys = {k for s in rec.values() for k in s if k.startswith("ssl/quality/")}
    assert {f"ssl/quality/{src}_recall" for src in ("teacher", "cam", "fused")} <= keys, keys
    for s in rec.values():
        assert all(0.0 <= v <= 1.0 for k, v in s.items() if k.startswith("ssl/quality/")), s
    truth = true_box_lookup(DatasetCatalog.get(ssl_run.trainer.cfg.DATASETS.TRAIN_WEAK[0]))
    cam = json.loads(ssl_run.cam.read_text())["images"]
    assert sum(match_counts(cam[i]["boxes"], t["boxes"])[0] for i, t in truth.items()) == 0
    for s in rec.values():
        assert s.get("ssl/quality/cam_precision", 0.0) == s.get("ssl/quality/cam_recall", 0.0) \
            == 0.0


def test_stage2_teacher_is_ema_of_student(ssl_run):
    t = ssl_run.trainer
    teacher, student = unwrap(t.teacher), unwrap(t.model)
    before = ssl_run.rec.teacher_before
    n_changed = 0
    for k, p in teacher.named_parameters():
        s = dict(student.named_parameters())[k].detach()
        # θ_t ← α θ_t + (1 − α) θ_s after the last optimizer step
        torch.testing.assert_close(p, ALPHA * before[k] + (1 - ALPHA) * s, rtol=0, atol=1e-6)
        n_changed += not torch.equal(p, ssl_run.init["teacher"][k])
    params = dict(teacher.named_parameters())
    assert n_changed > len(params) // 2, "the teacher barely moved from its initialisation"
    assert any(not torch.equal(params[k], v.detach()) for k, v in student.named_parameters())


def test_stage2_ssl_exact_resume(work, ssl_run):
    """Student AND teacher identical after 6 straight vs 3 + resume + 3 iterations."""
    opts = list(ssl_run.opts)
    opts[opts.index("OUTPUT_DIR") + 1] = str(work.dir / "ssl_resumed")
    t = _interrupted_then_resumed("braixdet", opts)
    resumed = load_ckpt(os.path.join(t.cfg.OUTPUT_DIR, "model_final.pth"))
    straight = load_ckpt(os.path.join(ssl_run.trainer.cfg.OUTPUT_DIR, "model_final.pth"))
    assert_state_equal(straight["model"], resumed["model"], "student")
    assert_state_equal(straight["teacher"], resumed["teacher"], "teacher")
    assert_state_equal(ssl_run.trainer.teacher.state_dict(), t.teacher.state_dict(),
                       "teacher in memory")


def test_teacher_only_export_loads_into_plain_model(work, ssl_run):
    t = ssl_run.trainer
    path = export_model_only(t.teacher, str(work.dir / "teacher_only.pth"))
    assert set(load_ckpt(path)) == {"model"}
    plain = build_model(t.cfg)  # detectron2's builder: no classifier init, no teacher wrapper
    DetectionCheckpointer(plain).load(path)
    plain.eval()
    teacher = unwrap(t.teacher).eval()
    loader = build_multiview_test_loader(t.cfg, t.cfg.DATASETS.TEST[-1])  # (val, test)
    images, dets = 0, 0
    with torch.no_grad():
        for batch in loader:  # a few test images (batch 1), boxes in original pixels
            a, b = teacher(batch)[0]["instances"], plain(batch)[0]["instances"]
            assert torch.equal(a.pred_boxes.tensor, b.pred_boxes.tensor)
            assert torch.equal(a.scores, b.scores)
            images, dets = images + 1, dets + len(a)
            if images == 3:
                break
    assert images == 3 and dets > 0, (images, dets)


# ------------------------------------------------------------------------------ baseline
def test_supervised_single_view_baseline(work):
    opts = _opts(work, work.dir / "frcnn", "faster_rcnn", max_iter=3)
    t = build_trainer("faster_rcnn", opts)
    assert not t.cfg.MODEL.BRAIXDET.MULTI_VIEW and not t.cfg.SSL.ENABLED
    losses = {}

    class Losses(HookBase):
        def after_step(self):
            losses[self.trainer.iter] = self.trainer.storage.history("total_loss").latest()

    t.register_hooks([Losses()])
    t.train()
    assert sorted(losses) == [0, 1, 2]
    assert all(math.isfinite(v) and v > 0 for v in losses.values()), losses
    assert os.path.isfile(os.path.join(t.cfg.OUTPUT_DIR, "model_final.pth"))


# ------------------------------------------------------------------------------ config.yaml
def test_run_reproduced_from_its_own_config_yaml(work):
    """A run's OUTPUT_DIR/config.yaml records what ran (the iterations its epochs came to, the
    ratio as parsed, the split folder, the datasets), so training again from that file alone,
    nothing but OUTPUT_DIR on the command line, gives bit-identical weights. (tools/train_net.py
    in this process: its cli.)"""
    import yaml
    from _train_helpers import CONFIGS

    from braixdet.pipeline.train_net import cli

    first, again = work.dir / "from_epochs", work.dir / "from_config_yaml"
    # 1e-6 epochs: one iteration (the schedule's minimum), decided by the epoch set's size
    opts = _opts(work, first, "mvccl", max_iter=-1, ckpt_period=-1, extra=[
        "SOLVER.BRAIXDET.EPOCHS", "1e-6", "TEST.EVAL_PERIOD", "-1",
        "DATASETS.BRAIXDET.RATIO", "2/4", "DATASETS.BRAIXDET.SPLIT_DIR", "",
        "DATASETS.TEST", '("cbis_ddsm_val_s0",)'])
    assert cli(["--config-file", CONFIGS["mvccl"], *map(str, opts)]) == 0
    with open(first / "config.yaml") as f:
        written = yaml.safe_load(f)
    s = written["SOLVER"]
    assert (s["MAX_ITER"], s["CHECKPOINT_PERIOD"]) == (1, written["TEST"]["EVAL_PERIOD"]) and \
        s["CHECKPOINT_PERIOD"] > 0
    b = written["DATASETS"]["BRAIXDET"]
    assert (b["RATIO"], b["SPLIT_DIR"]) == ("1/2", str(first / "splits"))
    assert written["DATASETS"]["TRAIN"] == ["cbis_ddsm_train_all_s0"]
    assert load_ckpt(first / "model_final.pth")["iteration"] == 0

    assert cli(["--config-file", str(first / "config.yaml"), "OUTPUT_DIR", str(again)]) == 0
    with open(again / "config.yaml") as f:
        assert yaml.safe_load(f) == dict(written, OUTPUT_DIR=str(again))
    assert_state_equal(load_ckpt(first / "model_final.pth")["model"],
                       load_ckpt(again / "model_final.pth")["model"], "weights")


def test_stage2_ssl_image_loss_on_boxed_and_weak_images(work, stage1, ssl_run):
    """MODEL.BRAIXDET.DET_IMAGE_LOSS_WEIGHT in the BRAIxDet SSL step: the detector's image loss
    trains on the boxed images and, weighted by λ like every weak term, on D_w's, whose image
    labels the paper trains on. The paper's classifier head reads another input (3C), so the
    image head starts fresh and nothing is refused."""
    opts = _opts(work, work.dir / "ssl_image_loss", "braixdet", max_iter=2, init_from=stage1.ckpt,
                 cam_json=ssl_run.cam, cam_iters=1,
                 extra=["TEST.BRAIXDET.EVAL_STUDENT", "False",
                        "MODEL.BRAIXDET.DET_IMAGE_LOSS_WEIGHT", "0.5"])
    t = build_trainer("braixdet", opts)
    head = {k: v.clone() for k, v in unwrap(t.model).image_head.state_dict().items()}

    class Losses(HookBase):
        seen = []

        def after_step(self):
            latest = self.trainer.storage.latest()
            self.seen.append({k: latest[k][0] for k in ("loss_image", "weak_loss_image")
                              if k in latest})

    t.register_hooks([Losses()])
    t.train()
    assert len(Losses.seen) == 2
    for s in Losses.seen:
        assert set(s) == {"loss_image", "weak_loss_image"}
        assert all(math.isfinite(v) and v > 0 for v in s.values())
    after = unwrap(t.model).image_head.state_dict()
    assert any(not torch.equal(after[k], head[k]) for k in head)  # trained
