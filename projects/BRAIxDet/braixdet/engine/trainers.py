"""Trainers of both stages, on detectron2's DefaultTrainer loop; ``trainer_class`` picks one.

* ``MVCCLTrainer``: stage 1, the BRAIxMVCCL classifier on D_w ∪ D̃_s.
* ``BRAIxDetTrainer``: stage 2 supervised on D_s (the Faster R-CNN baselines).
* ``StudentTeacherTrainer``: stage 2 student-teacher SSL (Mean Teacher / BRAIxDet).

What the base class changes in DefaultTrainer, and why: its own step trainer (reseeding per
iteration for exact resume, a finite-loss check before backward, mixed precision on CPU and GPU:
detectron2's AMPTrainer is CUDA/fp16 only), a data loader started lazily at the resumed
iteration, an atomic weights-only checkpointer, and a schedule in epochs
(config/schedule.py). Both stages keep the model of the best validation evaluation as the
exported model (``model_export.pth``) and leave its metrics as the run's. Everything else is
builders.
"""
import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from detectron2.data import DatasetCatalog
from detectron2.engine import DefaultTrainer, SimpleTrainer, TrainerBase, create_ddp_model
from detectron2.engine import hooks as d2_hooks
from detectron2.evaluation import inference_on_dataset, print_csv_format
from detectron2.modeling import build_model
from detectron2.solver import build_lr_scheduler
from detectron2.solver.build import get_default_optimizer_params, maybe_add_gradient_clipping
from detectron2.structures import Boxes
from detectron2.utils import comm
from detectron2.utils.events import get_event_storage

from ..cam import cam_boxes_in_input_frame
from ..config import has_weak_images, inference_cfg, resolve_schedule, validation_metric
from ..data.build import (
    build_multiview_test_loader,
    build_multiview_train_loader,
    build_stream_loader,
    train_seed,
    two_stream_names,
)
from ..data.mapper import MultiViewDatasetMapper
from ..evaluation import build_evaluator
from ..modeling.lcm import LocalCoOccurrenceModule
from ..modeling.rcnn import load_classifier_weights_from_cfg
from ..ssl.box_sources import source_lookup, true_box_lookup
from ..ssl.competitors import (
    build_strong_augment,
    keep_loss_terms,
    strong_augment,
    threshold_pseudo_targets,
)
from ..ssl.ema import apply_bn_mode, build_teacher, ema_momentum, ema_update, unwrap
from ..ssl.pseudo_labels import (
    fusion_iters_from_cfg,
    make_pseudo_targets,
    teacher_instances,
    teacher_top1,
)
from ..ssl.pseudo_quality import QualityWindow
from ..ssl.soft_teacher import reliable_for_regression, soft_teacher_losses
from ..utils.checkpoint import safe_torch_load
from .checkpoint import AtomicCheckpointer
from .hooks import (
    BestExportHook,
    FinalEvaluationCheckpointer,
    FiniteLossCheck,
    ReduceLROnPlateauHook,
    TrainingTimeHook,
)

logger = logging.getLogger(__name__)

__all__ = ["MVCCLTrainer", "BRAIxDetTrainer", "StudentTeacherTrainer", "trainer_class",
           "Precision", "EXPORT_NAME"]

EXPORT_NAME = "model_export.pth"  # the detector users deploy (teacher for SSL), best on val


class LazyResumableLoader:
    """An iterator that builds its DataLoader on the first ``next()``.

    detectron2's SimpleTrainer calls ``iter(loader)`` in its constructor, before the
    checkpoint (and so the start iteration) is known; the real loader must start at the resumed
    iteration to replay the same batches.
    """

    def __init__(self, build_fn):
        self._build_fn = build_fn
        self.start_iter = 0
        self._it = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self._it = iter(self._build_fn(self.start_iter))
        return next(self._it)


def scale_lr_of_modules(param_groups, model, module_type, factor):
    """``param_groups`` (get_default_optimizer_params's) with the lr of every parameter of a
    ``module_type`` module multiplied by ``factor``: such a parameter leaves its group for a
    copy of it. By parameter identity, so it works whatever the groups were merged by."""
    if factor == 1.0:
        return param_groups
    chosen = {id(p) for m in model.modules() if isinstance(m, module_type)
              for p in m.parameters()}
    out = []
    for group in param_groups:
        inside = [p for p in group["params"] if id(p) in chosen]
        outside = [p for p in group["params"] if id(p) not in chosen]
        if outside:
            out.append({**group, "params": outside})
        if inside:
            out.append({**group, "params": inside, "lr": group["lr"] * factor})
    return out


def seed_iteration(base_seed: int, iteration: int):
    """Make in-model randomness (e.g. RPN/ROI sampling) a function of (seed, iteration, rank);
    ``base_seed`` is data/build.py's train_seed(cfg)."""
    torch.manual_seed((max(base_seed, 0) * 1_000_003 + iteration * 4099 + comm.get_rank())
                      % (2**63 - 1))


@dataclass(frozen=True)
class Precision:
    """Mixed precision of the training step (SOLVER.AMP.ENABLED, SOLVER.BRAIXDET.AMP_DTYPE).

    Weights, optimizer state, the EMA teacher and batch-norm statistics stay fp32; autocast only
    runs the forward passes in ``dtype``. fp16 needs a gradient scaler, bf16 does not.
    """

    device_type: str = "cpu"
    dtype: Optional[torch.dtype] = None  # None: fp32

    @classmethod
    def from_cfg(cls, cfg):
        device_type = "cuda" if str(cfg.MODEL.DEVICE).startswith("cuda") else "cpu"
        if not cfg.SOLVER.AMP.ENABLED:
            return cls(device_type, None)
        want = cfg.SOLVER.BRAIXDET.AMP_DTYPE  # auto | bf16 | fp16 (config/checks.py)
        if want == "auto":
            return cls.auto(device_type)
        return cls(device_type, torch.bfloat16 if want == "bf16" else torch.float16)

    @classmethod
    def auto(cls, device_type):
        """bf16 where supported (CPU; CUDA with bf16), else fp16 (with a gradient scaler)."""
        bf16 = device_type == "cpu" or torch.cuda.is_bf16_supported()
        return cls(device_type, torch.bfloat16 if bf16 else torch.float16)

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype or torch.float32,
                              enabled=self.dtype is not None)

    def grad_scaler(self):
        return torch.amp.GradScaler(self.device_type, enabled=self.dtype == torch.float16)


class BRAIxStepTrainer(SimpleTrainer):
    """One optimisation step: reseed per iteration, forward under autocast (AMP), refuse
    non-finite losses by name before backward, scale gradients when fp16."""

    def __init__(self, model, data_loader, optimizer, seed=0, precision=Precision(),
                 check_finite=True):
        super().__init__(model, data_loader, optimizer)
        self.seed = seed
        self.precision = precision
        self.grad_scaler = precision.grad_scaler()
        self.finite_check = FiniteLossCheck(enabled=check_finite)

    def next_batch(self, loader_iter):
        start = time.perf_counter()
        data = next(loader_iter)
        return data, time.perf_counter() - start

    def optimize(self, loss_dict, data_time):
        self.finite_check(loss_dict, self.iter)
        losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        self.grad_scaler.scale(losses).backward()
        self._write_metrics(loss_dict, data_time)
        self.grad_scaler.step(self.optimizer)  # a plain step when the scaler is disabled
        self.grad_scaler.update()

    def run_step(self):
        assert self.model.training, "[BRAIxStepTrainer] model was changed to eval mode!"
        data, data_time = self.next_batch(self._data_loader_iter)
        # after the batch: a (lazily) started DataLoader draws its base seed from torch's RNG
        seed_iteration(self.seed, self.iter)
        with self.precision.autocast():
            loss_dict = self.model(data)
        self.optimize(loss_dict, data_time)

    def state_dict(self):
        ret = super().state_dict()
        if self.grad_scaler.is_enabled():
            ret["grad_scaler"] = self.grad_scaler.state_dict()
        return ret

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        if self.grad_scaler.is_enabled() and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])


class StudentTeacherStepTrainer(BRAIxStepTrainer):
    """One student-teacher step (paper eq. 5, Algorithm 2): ℓ_sup + λ ℓ_wek, then EMA."""

    def __init__(self, model, teacher, full_loader, weak_loader, optimizer, cfg, cam_lookup,
                 fusion_iters, precision=Precision(), truth_lookup=None):
        super().__init__(model, full_loader, optimizer, seed=train_seed(cfg),
                         precision=precision,
                         check_finite=cfg.SOLVER.BRAIXDET.CHECK_FINITE)
        self.teacher = teacher
        self.weak_loader = weak_loader
        self._weak_iter = iter(weak_loader)
        self.cam_lookup = cam_lookup
        self.fusion_iters = fusion_iters
        s = cfg.SSL
        self.lambda_weak, self.alpha, self.bn_mode = s.LAMBDA_WEAK, s.EMA_ALPHA, s.BN_MODE
        self.use_cam, self.nms_thresh = s.USE_CAM and bool(cam_lookup), s.PSEUDO_NMS_THRESH
        self.negative_as_background = s.NEGATIVE_AS_BACKGROUND
        self.score_thresh = s.TEACHER_SCORE_THRESH
        self.pseudo_mode = s.PSEUDO_LABELS  # top1 | threshold (config/checks.py)
        self.strong_aug = build_strong_augment(s.STRONG_AUG_POLICY) if s.STRONG_AUG else None
        self.strong_labelled = bool(s.STRONG_AUG_LABELLED)
        self.keep_top = bool(s.PSEUDO_KEEP_TOP)
        self.ema_ramp = bool(s.EMA_RAMP)
        self.cls_thresh = float(s.SOFT_TEACHER_CLS_THRESH)
        self.unsup_losses = tuple(s.UNSUP_LOSSES)
        self.burn_in_iters = int(s.BURN_IN_ITERS)
        self.soft_teacher = s.SOFT_TEACHER
        self.jitter = (s.JITTER_TIMES, s.JITTER_SCALE, s.REG_UNCERTAINTY_THRESH)
        # SSL.PSEUDO_QUALITY: D_w's truth, read by record_quality only (logging, never targets)
        self.truth_lookup = truth_lookup or {}
        self.quality = QualityWindow(iou_thresh=cfg.TEST.BRAIXDET.IOU_THRESH) \
            if self.truth_lookup else None

    def pseudo_targets(self, weak):
        """Algorithm 2 on a weak batch: the teacher's top box, fused with the GradCAM boxes
        while the fusion phase lasts; in the batch's (augmented) input frame."""
        with torch.no_grad(), self.precision.autocast():
            teacher_out = self.teacher.inference(weak, do_postprocess=False)
        if self.pseudo_mode == "threshold":  # the competitors' multi-box pseudo-labels
            targets = threshold_pseudo_targets(teacher_out, weak, self.score_thresh,
                                               keep_top=self.keep_top)
            cam_active = False
        else:
            cam_active = self.use_cam and self.iter < self.fusion_iters
            cam = cam_boxes_in_input_frame(weak, self.cam_lookup) if cam_active else {}
            targets = make_pseudo_targets(
                teacher_out, weak, cam, use_cam=cam_active,
                negative_as_background=self.negative_as_background,
                nms_thresh=self.nms_thresh, score_thresh=self.score_thresh)
        if self.quality is not None:
            self.record_quality(teacher_out, weak, targets)
        return targets, cam_active

    def record_quality(self, teacher_out, weak, targets):
        """SSL.PSEUDO_QUALITY: this batch's teacher, CAM-source and fused boxes against the
        truth, all in the batch's input frame (ssl/pseudo_quality.py)."""
        truth = cam_boxes_in_input_frame(weak, self.truth_lookup)
        cam = cam_boxes_in_input_frame(weak, self.cam_lookup) if self.cam_lookup else None
        empty = torch.zeros(0, 4)
        sources = {"teacher": [], "fused": [], **({"cam": []} if cam is not None else {})}
        truths = []
        for w, out, t in zip(weak, teacher_out, targets):
            image_id = str(w["image_id"])
            if image_id not in truth:
                continue
            gt = Boxes(truth[image_id][0])
            gt.clip(tuple(w["image"].shape[-2:]))
            truths.append(gt.tensor)
            fused = t.gt_boxes.tensor.cpu() if t is not None else empty
            sources["fused"].append(fused)
            sources["teacher"].append(
                teacher_top1(teacher_instances(out), self.score_thresh)[0].cpu()
                if self.pseudo_mode == "top1" else fused)
            if cam is not None:
                sources["cam"].append(cam.get(image_id, (empty,))[0])
        self.quality.add(sources, truths)

    def run_step(self):
        assert self.model.training, "[StudentTeacherStepTrainer] model was changed to eval mode!"
        full, t_full = self.next_batch(self._data_loader_iter)
        weak, t_weak = self.next_batch(self._weak_iter)
        seed_iteration(self.seed, self.iter)  # after the batches (see BRAIxStepTrainer)
        burn_in = self.iter < self.burn_in_iters
        if self.strong_labelled:  # Unbiased Teacher: labelled images as weak AND strong copies
            full = list(full) + [strong_augment(x, self.strong_aug) for x in full]
        weak_batch, cam_active = [], False
        if not burn_in:
            targets, cam_active = self.pseudo_targets(weak)
            weak_batch = [dict(w, instances=t) for w, t in zip(weak, targets) if t is not None]
            if self.soft_teacher and weak_batch:  # box jittering, on the teacher's images
                with self.precision.autocast():
                    ok = reliable_for_regression(self.teacher, weak_batch,
                                                 [w["instances"] for w in weak_batch],
                                                 *self.jitter)
                for w, flags in zip(weak_batch, ok):
                    w["instances"].gt_reg_ok = flags
            if self.strong_aug is not None:  # the student's copy only; the teacher saw `weak`
                weak_batch = [strong_augment(w, self.strong_aug) for w in weak_batch]

        with self.precision.autocast():
            loss_dict = dict(self.model(full))
            if weak_batch:
                # Through the unwrapped student: one DDP forward per backward; the weak
                # graph's gradients still reach every parameter's all-reduce hook.
                if self.soft_teacher:
                    weak_losses = soft_teacher_losses(self.model, self.teacher, weak_batch,
                                                      self.cls_thresh)
                else:
                    weak_losses = unwrap(self.model)(weak_batch)
                weak_losses = keep_loss_terms(weak_losses, self.unsup_losses)
                for k, v in weak_losses.items():
                    loss_dict["weak_" + k] = self.lambda_weak * v
        self.optimize(loss_dict, t_full + t_weak)
        # burn-in (Unbiased Teacher): the teacher follows the student exactly (alpha 0), so at
        # its end the teacher is a copy of the supervised student
        alpha = 0.0 if burn_in else ema_momentum(self.alpha, self.iter - self.burn_in_iters,
                                                 self.ema_ramp)
        ema_update(self.teacher, self.model, alpha=alpha, bn_mode=self.bn_mode)

        if comm.is_main_process():
            storage = get_event_storage()
            storage.put_scalar("ssl/weak_images_with_targets", len(weak_batch),
                               smoothing_hint=False)
            # thresholded teachers (the competitors) may give none: all-background images
            storage.put_scalar("ssl/pseudo_boxes",
                               sum(len(w["instances"]) for w in weak_batch),
                               smoothing_hint=False)
            storage.put_scalar("ssl/cam_fusion", float(cam_active), smoothing_hint=False)
            if self.quality is not None and not burn_in:
                for k, v in self.quality.scalars().items():
                    storage.put_scalar(k, v, smoothing_hint=False)


class BRAIxTrainerBase(DefaultTrainer):
    """Shared construction for every stage (see the module docstring)."""

    # DefaultTrainer.__init__ (0.6 and main) builds its own SimpleTrainer/AMPTrainer and
    # DetectionCheckpointer with no builder for them: the same steps with ours.
    def __init__(self, cfg):
        TrainerBase.__init__(self)
        # a config from config.resolve_cfg (train_net) is returned as it is; an unresolved one
        # (in-process use) gets its schedule in iterations here
        cfg = resolve_schedule(cfg)
        self.cfg = cfg
        model = self.build_model(cfg)
        optimizer = self.build_optimizer(cfg, model)
        model = create_ddp_model(model, broadcast_buffers=False)
        self.teacher = self.build_teacher(cfg, model)
        self._trainer = self.build_step_trainer(cfg, model, optimizer)
        self.scheduler = self.build_lr_scheduler(cfg, optimizer)
        self.checkpointer = AtomicCheckpointer(
            unwrap(model), cfg.OUTPUT_DIR, trainer=weakref.proxy(self),
            **self.extra_checkpointables())
        self.start_iter = 0
        self.max_iter = cfg.SOLVER.MAX_ITER
        self.register_hooks(self.build_hooks())

    # -- builders -----------------------------------------------------------------------------
    def build_teacher(self, cfg, model):
        """The EMA teacher of student-teacher stages; None for supervised training."""
        return None

    def build_step_trainer(self, cfg, model, optimizer):
        loader = LazyResumableLoader(lambda s: self.build_train_loader(cfg, start_iter=s))
        return BRAIxStepTrainer(model, loader, optimizer, seed=train_seed(cfg),
                                precision=Precision.from_cfg(cfg),
                                check_finite=cfg.SOLVER.BRAIXDET.CHECK_FINITE)

    def extra_checkpointables(self):
        return {}

    @classmethod
    def build_model(cls, cfg):
        model = build_model(cfg)
        logger.info("Model: %s with %.2fM parameters", type(model).__name__,
                    sum(p.numel() for p in model.parameters()) / 1e6)
        return model

    @classmethod
    def build_optimizer(cls, cfg, model):
        params = get_default_optimizer_params(
            model, base_lr=cfg.SOLVER.BASE_LR, weight_decay_norm=cfg.SOLVER.WEIGHT_DECAY_NORM)
        params = scale_lr_of_modules(params, model, LocalCoOccurrenceModule,
                                     cfg.MODEL.BRAIXDET.LCM.LR_FACTOR)
        # ADAM | SGD, any case (config/checks.py)
        if cfg.SOLVER.BRAIXDET.OPTIMIZER.upper() == "ADAM":
            # paper: Adam (stage 1 lr 1e-4 wd 1e-6; stage 2 lr 5e-5 wd 1e-5)
            opt_cls, kwargs = torch.optim.Adam, {"weight_decay": cfg.SOLVER.WEIGHT_DECAY}
        else:
            opt_cls = torch.optim.SGD
            kwargs = {"momentum": cfg.SOLVER.MOMENTUM, "nesterov": cfg.SOLVER.NESTEROV,
                      "weight_decay": cfg.SOLVER.WEIGHT_DECAY}
        return maybe_add_gradient_clipping(cfg, opt_cls)(params, lr=cfg.SOLVER.BASE_LR, **kwargs)

    @classmethod
    def build_lr_scheduler(cls, cfg, optimizer):
        return build_lr_scheduler(cfg, optimizer)

    @classmethod
    def build_train_loader(cls, cfg, start_iter=0):
        return build_multiview_train_loader(
            cfg, cfg.DATASETS.TRAIN, cfg.SOLVER.IMS_PER_BATCH, seed=train_seed(cfg),
            start_iter=start_iter)

    @classmethod
    def build_test_loader(cls, cfg, dataset_name):
        return build_multiview_test_loader(cfg, dataset_name)

    @classmethod
    def build_evaluator(cls, cfg, dataset_name, output_folder=None):
        output_folder = output_folder or os.path.join(cfg.OUTPUT_DIR, "inference", dataset_name)
        return build_evaluator(cfg, dataset_name, output_folder)

    def build_hooks(self):
        cfg = self.cfg
        ret = [d2_hooks.IterationTimer(), d2_hooks.LRScheduler(),
               d2_hooks.EvalHook(cfg.TEST.EVAL_PERIOD, self._test_and_save_results)]
        # after the evaluation they read; before the checkpointer, so that a checkpoint taken
        # at an evaluation iteration holds their decisions (exact resume)
        ret.extend(self.validation_hooks())
        ret.append(TrainingTimeHook(cfg.OUTPUT_DIR))  # before the checkpointer: saved up to date
        if comm.is_main_process():
            kept = cfg.SOLVER.BRAIXDET.CHECKPOINTS_KEPT
            ret.append(d2_hooks.PeriodicCheckpointer(self.checkpointer,
                                                     cfg.SOLVER.CHECKPOINT_PERIOD,
                                                     max_to_keep=kept or None))
            ret.append(d2_hooks.PeriodicWriter(self.build_writers(), period=20))
            if self.best_export.metric is not None:
                ret.append(FinalEvaluationCheckpointer(self.checkpointer))
        return ret

    def deploy_model(self):
        """The model users get (and stage 2 starts from): the trained model itself."""
        return unwrap(self.model)

    def validation_hooks(self):
        """ReduceLROnPlateau on the validation metric (paper §4.3), when there is validation,
        then the export of the best model on validation (paper: model selection), in both
        stages: stage 2 starts from the stage-1 export (``model_export.pth``)."""
        metric = validation_metric(self.cfg)
        self.best_export = BestExportHook(
            os.path.join(self.cfg.OUTPUT_DIR, EXPORT_NAME), self.deploy_model,
            metric.key if metric else None, metric.mode if metric else "max")
        if metric is None:
            return [self.best_export]
        s = self.cfg.SOLVER.BRAIXDET
        self.plateau = ReduceLROnPlateauHook(metric=metric.key, mode=metric.mode,
                                             factor=s.PLATEAU_FACTOR, patience=s.PLATEAU_PATIENCE)
        return [self.plateau, self.best_export]

    # -- checkpointed state --------------------------------------------------------------------
    # detectron2 0.6's DefaultTrainer checkpoints only the iteration and the hooks: without the
    # step trainer's state the optimizer (Adam moments, lr) would restart on resume.
    def state_dict(self):
        ret = super().state_dict()
        ret["_trainer"] = self._trainer.state_dict()
        return ret

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        if "_trainer" in state_dict:
            self._trainer.load_state_dict(state_dict["_trainer"])

    # -- loop ---------------------------------------------------------------------------------
    def resume_or_load(self, resume=True):
        super().resume_or_load(resume=resume)
        for loader in (self._trainer.data_loader, getattr(self._trainer, "weak_loader", None)):
            if isinstance(loader, LazyResumableLoader):
                loader.start_iter = self.start_iter

    def eval_datasets(self):
        """The validation set alone when there is one: model selection must not see the test
        set, which is scored once, on the exported model (_evaluate_export); every
        DATASETS.TEST set otherwise."""
        if validation_metric(self.cfg) is None:
            return None
        return self.cfg.DATASETS.TEST[:1]

    def _test_and_save_results(self):
        self._last_eval_results = shared_with_every_rank(
            self.test(self.cfg, self.model, datasets=self.eval_datasets()))
        return self._last_eval_results

    def train(self):
        results = super().train()
        self._evaluate_export()
        return results

    def export_eval_datasets(self):
        """What the exported model is evaluated on after training: the test sets (the first of
        DATASETS.TEST is the validation set that chose it)."""
        return list(self.cfg.DATASETS.TEST)[1:]

    def _evaluate_export(self):
        """Score the exported model, the one users deploy and stage 2 starts from, on
        export_eval_datasets(), less what the final evaluation already scored when the export
        is that evaluation's model."""
        hook = self.best_export
        if validation_metric(self.cfg) is None or hook.exported_iter is None:
            return
        scored = self.eval_datasets() if hook.exported_iter == hook.last_eval_iter else []
        datasets = [d for d in self.export_eval_datasets() if d not in scored]
        if not datasets:
            return
        comm.synchronize()  # the main process wrote the export; every rank reads it
        model = build_model(inference_cfg(self.cfg, hook.path))
        model.load_state_dict(safe_torch_load(hook.path)["model"])
        logger.info("Metrics of the exported model (iteration %d):", hook.exported_iter)
        results = shared_with_every_rank(self.test(self.cfg, model.eval(), datasets=datasets))
        final = getattr(self, "_last_eval_results", None) or {}
        self._last_eval_results = {**final, **results}

    @classmethod
    def test(cls, cfg, model, evaluators=None, prefix="", datasets=None):
        """Evaluate ``model`` on ``datasets`` (default cfg.DATASETS.TEST); metric keys get
        ``prefix`` (e.g. student/)."""
        results = {}
        for idx, name in enumerate(datasets or cfg.DATASETS.TEST):
            loader = cls.build_test_loader(cfg, name)
            out = os.path.join(cfg.OUTPUT_DIR, "inference", prefix.strip("/") or "model", name)
            evaluator = evaluators[idx] if evaluators else cls.build_evaluator(cfg, name, out)
            res = inference_on_dataset(model, loader, evaluator)
            if comm.is_main_process():
                logger.info("Evaluation results of %s%s:", prefix, name)
                print_csv_format(res)
            results[name] = res
        if len(results) == 1 and len(cfg.DATASETS.TEST) <= 1:  # keys as flat as detectron2's
            results = next(iter(results.values()))
        if prefix:
            results = {prefix.rstrip("/"): results}
        return results


def shared_with_every_rank(results):
    """Evaluation results as the main process has them, on every rank. The evaluators gather
    on the main process and return {} elsewhere, but the hooks that read the validation metric
    (ReduceLROnPlateau, the best export) must decide alike on every rank: an lr cut on one
    rank alone lets the replicas drift apart."""
    if comm.get_world_size() == 1:
        return results
    return comm.all_gather(results)[0]


class MVCCLTrainer(BRAIxTrainerBase):
    """Stage 1: BRAIxMVCCL classifier on D_w ∪ D̃_s, ReduceLROnPlateau on validation BCE; the
    best classifier on validation is exported (``model_export.pth``) for stage 2, and its
    validation and test metrics are the ones left in ``inference/model/`` at the end."""

    def export_eval_datasets(self):
        # the pipeline's classifier table reads both: they describe the model stage 2 uses
        return list(self.cfg.DATASETS.TEST)


class BRAIxDetTrainer(BRAIxTrainerBase):
    """Stage 2, supervised on D_s: the (multi-view) Faster R-CNN baselines.

    The model of the best validation evaluation is exported (``model_export.pth``) and its test
    metrics are the ones left in ``inference/model/<test set>`` at the end.
    """

    @classmethod
    def build_model(cls, cfg):
        model = super().build_model(cfg)
        if cfg.MODEL.BRAIXDET.INIT_FROM_CLASSIFIER:
            report = load_classifier_weights_from_cfg(model, cfg)
            logger.info("Initialised from classifier: %d tensors loaded, %d dropped",
                        len(report["loaded"]), len(report["dropped"]))
        return model


class StudentTeacherTrainer(BRAIxDetTrainer):
    """Stage 2 student-teacher SSL (paper §3.2-3.3): the teacher is the reported, evaluated and
    exported model; the student is also evaluated (``student/`` metrics). With a fixed teacher
    (EMA_ALPHA 1.0, STAC) the student is the method's model: it is reported and exported."""

    def teacher_is_fixed(self):
        return self.cfg.SSL.EMA_ALPHA >= 1.0

    def reported_model(self):
        return unwrap(self.model) if self.teacher_is_fixed() else unwrap(self.teacher)

    def build_teacher(self, cfg, model):
        return build_teacher(model)

    def build_step_trainer(self, cfg, model, optimizer):
        full_names, weak_names = two_stream_names(cfg)
        full = LazyResumableLoader(
            lambda s: build_stream_loader(cfg, "full", full_names, start_iter=s))
        weak = LazyResumableLoader(
            lambda s: build_stream_loader(cfg, "weak", weak_names, start_iter=s))
        weak_dicts = [d for n in cfg.DATASETS.TRAIN_WEAK for d in DatasetCatalog.get(n)]
        # Algorithm 2's boxes (SSL.CAM_BOX_SOURCE); only the oracle and random sources read the
        # truth, and the quality scalars get their own copy (ssl/box_sources.py)
        cam_lookup = source_lookup(cfg, weak_dicts,
                                   lambda: MultiViewDatasetMapper(cfg, is_train=True).cache,
                                   train_seed(cfg))
        truth_lookup = true_box_lookup(weak_dicts) if cfg.SSL.PSEUDO_QUALITY else {}
        if cfg.SSL.PSEUDO_QUALITY and not truth_lookup:
            logger.warning("SSL.PSEUDO_QUALITY: no weak cancer of D_w has known boxes; no "
                           "quality scalars")
        fusion_iters = fusion_iters_from_cfg(
            num_weak_images=len(weak_dicts),
            weak_batch_size=cfg.DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH,
            epochs=cfg.SSL.CAM_FUSION_EPOCHS, override_iters=cfg.SSL.CAM_FUSION_ITERS)
        if cam_lookup:  # experiment_box_sources.py reads this line
            logger.info("Algorithm 2: %s boxes fused during the first %d iterations",
                        cfg.SSL.CAM_BOX_SOURCE, fusion_iters)
        else:  # Mean Teacher and the competitors: nothing to fuse, whatever the window
            logger.info("Algorithm 2: off (no boxes to fuse: SSL.USE_CAM %s, SSL.CAM_JSON %r); "
                        "the pseudo-boxes are the teacher's", cfg.SSL.USE_CAM, cfg.SSL.CAM_JSON)
        return StudentTeacherStepTrainer(model, self.teacher, full, weak, optimizer, cfg,
                                         cam_lookup, fusion_iters, Precision.from_cfg(cfg),
                                         truth_lookup=truth_lookup)

    def extra_checkpointables(self):
        return {"teacher": self.teacher}

    def deploy_model(self):
        return self.reported_model()

    def resume_or_load(self, resume=True):
        super().resume_or_load(resume=resume)
        if not (resume and self.checkpointer.has_checkpoint()):
            # a fresh run: the teacher starts as a copy of the (initialised) student, or as
            # another detector (STAC: the supervised detector that labels D_w)
            path = self.cfg.SSL.TEACHER_WEIGHTS
            state = (safe_torch_load(path)["model"] if path else
                     unwrap(self.model).state_dict())
            self.teacher.load_state_dict(state)
        apply_bn_mode(self.model, self.teacher, self.cfg.SSL.BN_MODE)

    def train(self):
        # TrainerBase.train() calls model.train() nowhere else; keep BN modes after it
        apply_bn_mode(self.model, self.teacher, self.cfg.SSL.BN_MODE)
        return super().train()

    def _test_and_save_results(self):
        datasets = self.eval_datasets()
        results = self.test(self.cfg, self.reported_model(), datasets=datasets)
        if self.cfg.TEST.BRAIXDET.EVAL_STUDENT and not self.teacher_is_fixed():
            results = dict(results)
            results.update(self.test(self.cfg, unwrap(self.model), prefix="student/",
                                     datasets=datasets))
        # evaluating the student ends in its train(), which resets the BN modes
        self.model.train()
        apply_bn_mode(self.model, self.teacher, self.cfg.SSL.BN_MODE)
        self._last_eval_results = shared_with_every_rank(results)
        return self._last_eval_results


def trainer_class(cfg):
    """The trainer for a config: the classifier (stage 1), or a detector with or without SSL."""
    if cfg.MODEL.META_ARCHITECTURE == "MVCCLClassifier":
        return MVCCLTrainer
    if cfg.SSL.ENABLED and not has_weak_images(cfg):
        # e.g. the fully supervised protocol without weak cases: nothing to pseudo-label
        logger.warning("SSL.ENABLED but D_w (%s) holds no image: training the supervised part "
                       "only (BRAIxDetTrainer)", list(cfg.DATASETS.TRAIN_WEAK))
        return BRAIxDetTrainer
    return StudentTeacherTrainer if cfg.SSL.ENABLED else BRAIxDetTrainer
