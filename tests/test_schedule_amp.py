"""Schedules in epochs, validation-driven plateau + best export, mixed precision, and refused
detectron2 keys (issues #12 and #13), on tiny runs of the synthetic dataset."""
import json
import math
import os
import types

import pytest
import torch
from _train_helpers import CONFIGS, assert_state_equal, build_trainer, load_ckpt, tiny_opts
from detectron2.data import DatasetCatalog
from detectron2.engine.train_loop import HookBase

from braixdet.config import build_cfg, resolve_cfg
from braixdet.config.schedule import resolve_schedule, stage2_epochs_opts
from braixdet.engine.hooks import ReduceLROnPlateauHook
from braixdet.ssl.pseudo_labels import fusion_iters_from_cfg


@pytest.fixture(scope="module")
def work(tmp_path_factory, synthetic_root):
    d = tmp_path_factory.mktemp("schedule_amp")
    return types.SimpleNamespace(root=synthetic_root.root, dir=d, cache=d / "cache")


def _cfg(work, stage, extra=()):
    opts = tiny_opts(work.root, work.dir / stage, work.cache, stage=stage, extra=extra)
    cfg = build_cfg(CONFIGS[stage], opts)
    cfg = resolve_cfg(cfg)
    return cfg


@pytest.mark.parametrize("stage", ["mvccl", "braixdet", "faster_rcnn"])
def test_epochs_set_the_iterations(work, stage):
    cfg = _cfg(work, stage, ["SOLVER.MAX_ITER", "-1", "SOLVER.BRAIXDET.EPOCHS", "3.0",
                             "TEST.EVAL_PERIOD", "-1", "SOLVER.CHECKPOINT_PERIOD", "-1"])
    if stage == "mvccl":  # stage 1: an epoch is D_s ∪ D_w at IMS_PER_BATCH
        n, batch = len(DatasetCatalog.get(cfg.DATASETS.TRAIN[0])), cfg.SOLVER.IMS_PER_BATCH
    else:  # stage 2, every detector: an epoch is D_w at the weak batch
        n = len(DatasetCatalog.get(cfg.DATASETS.TRAIN_WEAK[0]))
        batch = cfg.DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH
    ipe = math.ceil(n / batch)
    out = resolve_schedule(cfg)
    assert (out.SOLVER.MAX_ITER, out.TEST.EVAL_PERIOD, out.SOLVER.CHECKPOINT_PERIOD) == (
        3 * ipe, ipe, ipe)
    # explicit iteration counts win
    cfg.SOLVER.MAX_ITER, cfg.TEST.EVAL_PERIOD, cfg.SOLVER.CHECKPOINT_PERIOD = 7, 0, 5
    assert resolve_schedule(cfg) is cfg and cfg.SOLVER.MAX_ITER == 7


def _fusion_iters(cfg):
    return fusion_iters_from_cfg(len(DatasetCatalog.get(cfg.DATASETS.TRAIN_WEAK[0])),
                                 cfg.DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH,
                                 epochs=cfg.SSL.CAM_FUSION_EPOCHS,
                                 override_iters=cfg.SSL.CAM_FUSION_ITERS)


def test_gradcam_fusion_covers_two_of_twenty_epochs(work):
    cfg = _cfg(work, "braixdet", ["SOLVER.MAX_ITER", "-1", "SOLVER.BRAIXDET.EPOCHS", "20.0",
                                  "SSL.CAM_FUSION_EPOCHS", "2.0", "SSL.CAM_FUSION_ITERS", "-1"])
    assert _fusion_iters(cfg) * 10 == resolve_schedule(cfg).SOLVER.MAX_ITER


@pytest.mark.parametrize("epochs", [3.0, 6.0, 20.0])
def test_a_changed_schedule_keeps_the_papers_fusion_share(work, epochs):
    """stage2_epochs_opts, which the experiment scripts and the demo use to set the detectors'
    epochs, moves Algorithm 2's window with the schedule: 2 of 20 epochs of D_w at any length.
    The demo config's 0.3 alone, at 6 epochs, was half that share (RESULTS §22, 2026-12-01)."""
    moved = _cfg(work, "braixdet", ["SOLVER.MAX_ITER", "-1", *stage2_epochs_opts(epochs)])
    assert moved.SSL.CAM_FUSION_ITERS == -1  # tiny_opts' default: the epochs decide
    n, batch = len(DatasetCatalog.get(moved.DATASETS.TRAIN_WEAK[0])), \
        moved.DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH
    assert _fusion_iters(moved) == math.ceil(epochs / 10 * n / batch - 1e-9)
    assert resolve_schedule(moved).SOLVER.MAX_ITER == round(epochs * math.ceil(n / batch))
    kept = _cfg(work, "braixdet", ["SOLVER.MAX_ITER", "-1", "SOLVER.BRAIXDET.EPOCHS",
                                   str(epochs)])
    assert kept.SSL.CAM_FUSION_EPOCHS == 0.3  # absolute: the config's own window
    assert (_fusion_iters(kept) == _fusion_iters(moved)) == (epochs == 3.0)


class MetricLog(HookBase):
    """Validation metric and lr after every step (after the plateau hook ran)."""

    def __init__(self, key):
        self.key, self.values, self.lrs = key, {}, []

    def after_step(self):
        latest = self.trainer.storage.latest()
        if self.key in latest:
            value, it = latest[self.key]
            self.values[it] = value
        self.lrs.append(self.trainer.optimizer.param_groups[0]["lr"])

    def after_train(self):  # the final evaluation runs in EvalHook.after_train
        self.after_step()


VAL = "cbis_ddsm_train_full_full_s0"  # lesions in it: a validation AP that moves


def validated_detector_opts(work, out, max_iter):
    """A tiny supervised detector evaluated every 2 iterations on (VAL, test), patience 0."""
    return tiny_opts(work.root, out, work.cache, stage="faster_rcnn", max_iter=max_iter,
                     eval_period=2, extra=[
                         "DATASETS.BRAIXDET.PROTOCOL", "full", "SOLVER.BASE_LR", "0.003",
                         "SOLVER.BRAIXDET.PLATEAU_PATIENCE", "0",
                         "DATASETS.TEST", repr((VAL, "cbis_ddsm_test"))])


def first_best(values):
    """The iteration of the first best value of {iteration: value} (the export's choice)."""
    return max(sorted(values), key=lambda it: (values[it], -it))


def test_plateau_and_best_export_follow_validation(work):
    """Supervised detector, evaluated every 2 iterations on (validation, test): the exported
    model is the one of the best validation AP, the lr drops after a non-improving
    evaluation (patience 0), and the test metrics left on disk are the exported model's."""
    out = work.dir / "best"
    t = build_trainer("faster_rcnn", validated_detector_opts(work, out, max_iter=8))
    key = f"{VAL}/bbox/AP20"
    log = MetricLog(key)
    t.register_hooks([log])
    scored = record_scored_datasets(t)
    t.train()
    assert t.plateau.resolved_key == key and t.plateau.mode == "max"
    history = [log.values[it] for it in sorted(log.values)]
    assert len(history) == 4  # iterations 1, 3, 5 and the final evaluation
    best_it = first_best(log.values)
    export = load_ckpt(out / "model_export.pth")
    assert export["selected"]["iteration"] == best_it
    assert export["selected"]["value"] == pytest.approx(max(history))
    # patience 0: every evaluation that is not a new best reduces the lr ×0.1, the final one
    # included (its cut is what a longer run would train with)
    bad = sum(v <= max(history[:i]) for i, v in enumerate(history) if i > 0)
    assert t.plateau.num_reductions == bad
    if bad:
        assert min(log.lrs) < max(log.lrs)
    # the test set is scored once, on the export: model selection never sees it
    assert scored.count("cbis_ddsm_test") == 1 and scored[-1] == "cbis_ddsm_test"
    assert scored.count(VAL) == len(history)
    assert not any(k.startswith("cbis_ddsm_test/") for k in t.storage.histories())
    assert t._last_eval_results["cbis_ddsm_test"]["bbox"]["AP20"] == pytest.approx(
        json.loads((out / "inference" / "model" / "cbis_ddsm_test" / "metrics.json")
                   .read_text())["bbox"]["AP20"], nan_ok=True)
    # the test metrics on disk are those of the exported model
    from detectron2.modeling import build_model

    from braixdet.engine.trainers import BRAIxDetTrainer

    on_disk = json.loads((out / "inference" / "model" / "cbis_ddsm_test" / "metrics.json")
                         .read_text())  # read before test() below writes there again
    model = build_model(t.cfg)
    model.load_state_dict(export["model"])
    again = BRAIxDetTrainer.test(t.cfg, model.eval(), datasets=["cbis_ddsm_test"])
    for k in ("AP20", "R@0.5"):
        assert on_disk["bbox"][k] == pytest.approx(again["cbis_ddsm_test"]["bbox"][k],
                                                   nan_ok=True, abs=1e-9)


def test_a_finished_run_extended_resumes_after_its_final_evaluation(work):
    """detectron2 runs the final evaluation in after_train, after the last checkpoint: the
    final checkpoint must hold what the plateau and export hooks made of it. Otherwise a finished
    run resumed with a longer schedule forgets its best evaluation (RESULTS §35: the log named
    iteration 365 as the export, the file held epoch 2's) and may export a worse model over it."""
    out = work.dir / "extended"
    key = f"{VAL}/bbox/AP20"
    first = build_trainer("faster_rcnn", validated_detector_opts(work, out, max_iter=4))
    log = MetricLog(key)
    first.register_hooks([log])
    first.train()
    # the last evaluation ran in after_train, which stores it at the iteration count, 4
    assert sorted(log.values) == [1, 4]
    hooks = load_ckpt(out / "model_final.pth")["trainer"]["hooks"]
    assert hooks["BestExportHook"]["last_eval_iter"] == 4
    assert hooks["BestExportHook"]["best"] == pytest.approx(first.best_export.best)
    assert hooks["ReduceLROnPlateauHook"] == first.plateau.state_dict()
    # the plateau hook counted both evaluations (a cut after the last one included, patience
    # 0), as a fresh hook fed the same values does: the extended run cuts when an
    # uninterrupted one would (RESULTS §36: it had missed the final one)
    plateau = first.plateau
    reference = ReduceLROnPlateauHook(metric=key, mode=plateau.mode, factor=plateau.factor,
                                      patience=plateau.patience,
                                      optimizer=torch.optim.SGD([torch.zeros(1)], lr=1.0))
    reference.step(log.values[1])
    reference.step(log.values[4])
    saved = hooks["ReduceLROnPlateauHook"]
    assert saved["last_eval_iter"] == 4
    assert saved["best"] == pytest.approx(reference.best)
    assert (saved["num_bad_evals"], saved["num_reductions"]) == \
        (reference.num_bad_evals, reference.num_reductions)
    # four more iterations: the run goes on after iteration 3, knowing its last evaluation
    more = build_trainer("faster_rcnn", validated_detector_opts(work, out, max_iter=8),
                         resume=True)
    assert more.start_iter == 4
    assert more.best_export.state_dict() == first.best_export.state_dict()
    log2 = MetricLog(key)
    more.register_hooks([log2])
    more.train()
    values = {**log.values, **log2.values}
    assert sorted(values) == [1, 4, 5, 8]
    assert load_ckpt(out / "model_export.pth")["selected"]["iteration"] == first_best(values)


def record_scored_datasets(trainer):
    """The datasets ``trainer`` scores, in order (every call of its ``test``)."""
    scored, test = [], trainer.test

    def recording(cfg, model, evaluators=None, prefix="", datasets=None):
        scored.extend(datasets or cfg.DATASETS.TEST)
        return test(cfg, model, evaluators, prefix, datasets)
    trainer.test = recording
    return scored


def test_export_at_the_final_evaluation_scores_the_test_set_once(work):
    """When the export is the final evaluation's model (here the only evaluation), the test
    set is still scored once, after the validation set, and its metrics are on disk."""
    out = work.dir / "export_last"
    opts = tiny_opts(work.root, out, work.cache, stage="faster_rcnn", max_iter=3,
                     eval_period=100, extra=["DATASETS.BRAIXDET.PROTOCOL", "full"])
    t = build_trainer("faster_rcnn", opts)
    scored = record_scored_datasets(t)
    t.train()
    val, test = t.cfg.DATASETS.TEST
    assert t.best_export.exported_iter == t.best_export.last_eval_iter
    assert scored == [val, test]
    assert (out / "inference" / "model" / test / "metrics.json").is_file()


def test_stage1_metrics_on_disk_are_the_exported_classifiers(work):
    """Stage 1 exports its best validation BCE (what stage 2 starts from): the validation and
    test metrics it leaves on disk (the pipeline's classifier table) are that model's, not the
    last iteration's, also when the export is an earlier evaluation (asserted: a high lr makes
    the last evaluations worse)."""
    from detectron2.modeling import build_model

    from braixdet.engine.trainers import MVCCLTrainer

    out = work.dir / "stage1_export"
    t = build_trainer("mvccl", tiny_opts(work.root, out, work.cache, stage="mvccl", max_iter=8,
                                         eval_period=2, extra=["SOLVER.BASE_LR", "0.05"]))
    scored = record_scored_datasets(t)
    t.train()
    hook = t.best_export
    assert hook.exported_iter != hook.last_eval_iter  # the case the re-evaluation is for
    assert len(t.cfg.DATASETS.TEST) == 2
    val, test = t.cfg.DATASETS.TEST
    assert scored[-2:] == [val, test] and scored.count(test) == 1  # the export's, only
    on_disk = {name: json.loads((out / "inference" / "model" / name /
                                 "classification_metrics.json").read_text())["classification"]
               for name in t.cfg.DATASETS.TEST}  # read before test() below writes there again
    export = load_ckpt(out / "model_export.pth")
    model = build_model(t.cfg)
    model.load_state_dict(export["model"])
    again = MVCCLTrainer.test(t.cfg, model.eval())
    for name in t.cfg.DATASETS.TEST:
        for k in ("AUC", "BCE", "ACC"):  # JSON writes a one-class split's NaN AUC as null
            want = again[name]["classification"][k]
            got = on_disk[name][k]
            assert math.isnan(want) if got is None else got == pytest.approx(want, abs=1e-9), \
                (name, k)


class DtypeProbe(HookBase):
    """dtype of the first encoder conv output during the student's training forward."""

    def before_train(self):
        self.dtypes = []
        conv = next(m for m in self.trainer.model.modules() if isinstance(m, torch.nn.Conv2d))
        conv.register_forward_hook(
            lambda m, i, o: self.dtypes.append(o.dtype) if m.training else None)


def _without_evaluation(trainer):
    from detectron2.engine.hooks import EvalHook

    trainer._hooks = [h for h in trainer._hooks if not isinstance(h, EvalHook)]
    return trainer


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_amp_reaches_the_step_and_resumes_exactly(work, dtype, torch_dtype):
    """SOLVER.AMP.ENABLED: the student runs in low precision (CPU autocast), teacher and BN
    statistics stay fp32, fp16's gradient scaler is checkpointed, and 1 + resume + 1
    iterations equal 2 straight. CPU fp16 convolutions are emulated and slow: a small random
    encoder and no evaluation (what is tested is the precision and the resume)."""
    amp = ["SOLVER.AMP.ENABLED", "True", "SOLVER.BRAIXDET.AMP_DTYPE", dtype,
           "SOLVER.CHECKPOINT_PERIOD", "1", "MODEL.FPN.OUT_CHANNELS", "16",
           "MODEL.ROI_BOX_HEAD.FC_DIM", "32", "MODEL.BRAIXDET.TIMM_MODEL",
           "mobilenetv3_small_050", "MODEL.BRAIXDET.PRETRAINED", "",
           "INPUT.BRAIXDET.CANONICAL_SIZE", "(64, 32)"]
    straight_out = work.dir / f"amp_{dtype}"
    t = _without_evaluation(build_trainer(
        "braixdet", tiny_opts(work.root, straight_out, work.cache, max_iter=2, extra=amp)))
    assert t._trainer.precision.dtype == torch_dtype
    probe = DtypeProbe()
    t.register_hooks([probe])
    t.train()
    assert probe.dtypes and set(probe.dtypes) == {torch_dtype}
    teacher_state = t.teacher.state_dict()
    assert all(v.dtype in (torch.float32, torch.int64) for v in teacher_state.values())
    final = load_ckpt(straight_out / "model_final.pth")
    assert ("grad_scaler" in final["trainer"]["_trainer"]) == (dtype == "fp16")

    resumed_out = work.dir / f"amp_{dtype}_resumed"
    opts = tiny_opts(work.root, resumed_out, work.cache, max_iter=2, extra=amp)

    class Stop(HookBase):
        def after_step(self):
            if self.trainer.iter == 0:
                raise KeyboardInterrupt

    t = _without_evaluation(build_trainer("braixdet", opts))
    t.register_hooks([Stop()])
    with pytest.raises(KeyboardInterrupt):
        t.train()
    t = _without_evaluation(build_trainer("braixdet", opts, resume=True))
    assert t.start_iter == 1
    t.train()
    resumed = load_ckpt(resumed_out / "model_final.pth")
    assert_state_equal(final["model"], resumed["model"], "student")
    assert_state_equal(final["teacher"], resumed["teacher"], "teacher")
    if dtype == "fp16":
        scaler = [c["trainer"]["_trainer"]["grad_scaler"] for c in (final, resumed)]
        assert scaler[0] == scaler[1]


@pytest.mark.parametrize("key,value", [
    ("TEST.PRECISE_BN.ENABLED", "True"), ("TEST.AUG.ENABLED", "True"),
    ("DATALOADER.SAMPLER_TRAIN", "RepeatFactorTrainingSampler"),
    ("DATALOADER.FILTER_EMPTY_ANNOTATIONS", "True"), ("MODEL.BACKBONE.FREEZE_AT", "2"),
    ("INPUT.MIN_SIZE_TEST", "1000"), ("INPUT.RANDOM_FLIP", "vertical"), ("MODEL.MASK_ON", "True"),
])
def test_detectron2_keys_we_do_not_honour_are_refused(key, value):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_cfg(CONFIGS["braixdet"], [key, value])
    build_cfg(CONFIGS["braixdet"])  # the shipped configs leave them alone


def test_every_shipped_config_resolves_from_epochs():
    """The paper configs ask for 20 epochs per stage (MAX_ITER -1)."""
    for path in ("MVCCL/mvccl.yaml", "BRAIxDet/braixdet.yaml", "baselines/faster_rcnn.yaml"):
        cfg = build_cfg(os.path.join(os.path.dirname(CONFIGS["mvccl"]), "..", "..", path))
        assert cfg.SOLVER.MAX_ITER == -1 and cfg.SOLVER.BRAIXDET.EPOCHS == 20
        assert cfg.TEST.EVAL_PERIOD == -1


def test_full_protocol_without_weak_images_sizes_epochs_by_d_s(work):
    """--protocol full on a source without weak cases: D_w is empty, an epoch is D_s at
    IMS_PER_BATCH, and a student-teacher config trains its supervised part only."""
    from braixdet.engine import BRAIxDetTrainer, StudentTeacherTrainer, trainer_class

    epochs = ["DATASETS.BRAIXDET.PROTOCOL", "full", "SOLVER.MAX_ITER", "-1",
              "SOLVER.BRAIXDET.EPOCHS", "3.0", "TEST.EVAL_PERIOD", "-1",
              "SOLVER.CHECKPOINT_PERIOD", "-1"]
    for stage in ("braixdet", "faster_rcnn"):
        cfg = _cfg(work, stage, epochs)
        assert DatasetCatalog.get(cfg.DATASETS.TRAIN_WEAK[0]) == []  # CBIS: every image full
        ipe = math.ceil(len(DatasetCatalog.get(cfg.DATASETS.TRAIN[0]))
                        / cfg.SOLVER.IMS_PER_BATCH)
        out = resolve_schedule(cfg)
        assert (out.SOLVER.MAX_ITER, out.TEST.EVAL_PERIOD) == (3 * ipe, ipe)
        assert trainer_class(cfg) is BRAIxDetTrainer
    # with weak images (partial protocol) the SSL trainer is kept
    assert trainer_class(_cfg(work, "braixdet")) is StudentTeacherTrainer


def test_plateau_can_follow_the_validation_bce(work):
    """SOLVER.BRAIXDET.PLATEAU_METRIC "screening/image_BCE" (the paper's validation BCE, for a
    detector): minimised, followed by ReduceLROnPlateau and the export; the plateau hook finds
    detectron2's LRScheduler hook among the trainer's hooks."""
    from detectron2.engine.hooks import LRScheduler

    from braixdet.config.schedule import validation_metric

    val = "cbis_ddsm_val_s0"
    extra = ["DATASETS.BRAIXDET.PROTOCOL", "full", "DATASETS.TEST", repr((val, "cbis_ddsm_test")),
             "SOLVER.BRAIXDET.PLATEAU_METRIC", "screening/image_BCE",
             "SOLVER.BRAIXDET.PLATEAU_PATIENCE", "0", "MODEL.BRAIXDET.TIMM_MODEL",
             "mobilenetv3_small_050", "MODEL.BRAIXDET.PRETRAINED", ""]  # small: 3 evaluations
    metric = validation_metric(_cfg(work, "faster_rcnn", [*extra, "TEST.EVAL_PERIOD", "1"]))
    assert (metric.key, metric.mode) == (f"{val}/screening/image_BCE", "min")
    out = work.dir / "plateau_bce"
    t = build_trainer("faster_rcnn", tiny_opts(work.root, out, work.cache, stage="faster_rcnn",
                                               max_iter=2, eval_period=1, extra=extra))
    log = MetricLog(metric.key)
    t.register_hooks([log])
    t.train()
    assert t.plateau.resolved_key == metric.key and t.plateau.mode == "min"
    history = [log.values[it] for it in sorted(log.values)]
    assert len(history) == 2 and all(0 < v < 20 for v in history)
    export = load_ckpt(out / "model_export.pth")["selected"]
    assert export["metric"] == metric.key and export["value"] == pytest.approx(min(history))
    sched = next(h.scheduler for h in t._hooks if isinstance(h, LRScheduler))
    assert t.plateau._get_scheduler() is sched


def test_paper_config_has_torchvision_faster_rcnn_defaults():
    """Paper configs: torchvision's Faster R-CNN defaults but NMS 0.2 and ROI IoU 0.2 (§4.3)."""
    from detectron2.modeling import build_model

    path = os.path.join(os.path.dirname(CONFIGS["mvccl"]), "..", "..", "BRAIxDet", "braixdet.yaml")
    cfg = build_cfg(path, ["MODEL.BRAIXDET.PRETRAINED", "", "MODEL.DEVICE", "cpu"])
    assert cfg.DATASETS.BRAIXDET.TEST_IMAGES == "paper"
    model = build_model(cfg)
    strides = {k: v.stride for k, v in model.backbone.output_shape().items()}
    assert strides == {"p2": 4, "p3": 8, "p4": 16, "p5": 32, "p6": 64}
    rpn = model.proposal_generator
    assert rpn.anchor_generator.strides == [4, 8, 16, 32, 64]
    assert [a.shape[0] for a in rpn.anchor_generator.cell_anchors] == [3] * 5
    sides = [float((c[:, 2] - c[:, 0]).mul(c[:, 3] - c[:, 1]).sqrt().mean())
             for c in rpn.anchor_generator.cell_anchors]
    assert sides == pytest.approx([32, 64, 128, 256, 512], rel=1e-3)
    assert (rpn.pre_nms_topk[True], rpn.post_nms_topk[True]) == (2000, 2000)
    assert (rpn.pre_nms_topk[False], rpn.post_nms_topk[False]) == (1000, 1000)
    roi = model.roi_heads
    assert roi.batch_size_per_image == 512 and roi.proposal_matcher.thresholds[1] == 0.2
    assert roi.in_features == ["p2", "p3", "p4", "p5"]
    pred = roi.box_predictor
    assert (pred.test_score_thresh, pred.test_nms_thresh) == (0.05, 0.2)
