"""Trainers for both stages, on detectron2's DefaultTrainer loop.

What we override, and why:
* ``__init__``: build our own inner step trainer, a lazily started resumable loader (its data
  order depends on the iteration we resume from, known only after ``resume_or_load``) and an
  atomic, weights_only-safe checkpointer (plus the teacher in stage 2).
* ``run_step``: reseed torch per (iteration, rank) so a resumed run replays exactly; check every
  loss term is finite *before* backward (the error names the iteration and the term).
* loaders / evaluators / hooks: the multi-view loaders, our evaluators, ReduceLROnPlateau.
"""
import logging
import os
import time
import weakref

import torch
from detectron2.engine import DefaultTrainer, SimpleTrainer, TrainerBase, create_ddp_model
from detectron2.engine import hooks as d2_hooks
from detectron2.evaluation import inference_on_dataset, print_csv_format
from detectron2.modeling import build_model
from detectron2.solver import build_lr_scheduler
from detectron2.solver.build import get_default_optimizer_params, maybe_add_gradient_clipping
from detectron2.utils import comm
from detectron2.utils.events import get_event_storage

from ..data.build import (
    build_multiview_test_loader,
    build_multiview_train_loader,
    build_two_stream_loaders,
)
from ..evaluation import build_evaluator
from ..ssl.cam_boxes import cam_boxes_in_input_frame, load_cam_boxes
from ..ssl.ema import apply_bn_mode, build_teacher, ema_update, unwrap
from ..ssl.pseudo_labels import fusion_iters_from_cfg, make_pseudo_targets
from .checkpoint import AtomicCheckpointer, export_model_only
from .hooks import ReduceLROnPlateauHook, check_finite_losses

logger = logging.getLogger(__name__)


class LazyResumableLoader:
    """An iterator that builds its DataLoader on the first ``next()``.

    detectron2 0.6's SimpleTrainer calls ``iter(loader)`` in its constructor, before the
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


def seed_iteration(base_seed: int, iteration: int):
    """Make in-model randomness (e.g. RPN/ROI sampling) a function of (seed, iteration, rank)."""
    torch.manual_seed((max(base_seed, 0) * 1_000_003 + iteration * 4099 + comm.get_rank())
                      % (2**63 - 1))


class BRAIxStepTrainer(SimpleTrainer):
    """SimpleTrainer whose step reseeds per iteration and refuses non-finite losses by name."""

    def __init__(self, model, data_loader, optimizer, seed=0):
        super().__init__(model, data_loader, optimizer)
        self.seed = seed

    def next_batch(self, loader_iter):
        start = time.perf_counter()
        data = next(loader_iter)
        return data, time.perf_counter() - start

    def optimize(self, loss_dict, data_time):
        check_finite_losses(loss_dict, self.iter)
        losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        losses.backward()
        self._write_metrics(loss_dict, data_time)
        self.optimizer.step()

    def run_step(self):
        assert self.model.training, "[BRAIxStepTrainer] model was changed to eval mode!"
        data, data_time = self.next_batch(self._data_loader_iter)
        # after the batch: a (lazily) started DataLoader draws its base seed from torch's RNG
        seed_iteration(self.seed, self.iter)
        self.optimize(self.model(data), data_time)


class StudentTeacherStepTrainer(BRAIxStepTrainer):
    """One BRAIxDet SSL step (paper eq. 5, Algorithm 2): ℓ_sup + λ ℓ_wek, then EMA."""

    def __init__(self, model, teacher, full_loader, weak_loader, optimizer, cfg, cam_lookup,
                 fusion_iters):
        super().__init__(model, full_loader, optimizer, seed=cfg.SEED)
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

    def run_step(self):
        assert self.model.training, "[StudentTeacherStepTrainer] model was changed to eval mode!"
        full, t_full = self.next_batch(self._data_loader_iter)
        weak, t_weak = self.next_batch(self._weak_iter)
        seed_iteration(self.seed, self.iter)  # after the batches (see BRAIxStepTrainer)

        with torch.no_grad():  # the teacher labels the weak batch in canonical coordinates
            teacher_out = self.teacher.inference(weak, do_postprocess=False)
        cam_active = self.use_cam and self.iter < self.fusion_iters
        cam = cam_boxes_in_input_frame(weak, self.cam_lookup) if cam_active else {}
        targets = make_pseudo_targets(
            teacher_out, weak, cam,
            use_cam=cam_active,
            negative_as_background=self.negative_as_background,
            nms_thresh=self.nms_thresh, score_thresh=self.score_thresh)
        weak_batch = [dict(w, instances=t) for w, t in zip(weak, targets) if t is not None]

        loss_dict = dict(self.model(full))
        if weak_batch:
            # Through the unwrapped student: one DDP forward per backward; the weak graph's
            # gradients still reach every parameter's all-reduce hook in the single backward.
            weak_losses = unwrap(self.model)(weak_batch)
            for k, v in weak_losses.items():
                loss_dict["weak_" + k] = self.lambda_weak * v
        self.optimize(loss_dict, t_full + t_weak)
        ema_update(self.teacher, self.model, alpha=self.alpha, bn_mode=self.bn_mode)

        if comm.is_main_process():
            storage = get_event_storage()
            storage.put_scalar("ssl/weak_images_with_targets", len(weak_batch),
                               smoothing_hint=False)
            storage.put_scalar("ssl/cam_fusion", float(cam_active), smoothing_hint=False)


class BRAIxTrainerBase(DefaultTrainer):
    """Shared construction for both stages (see module docstring)."""

    def __init__(self, cfg):
        TrainerBase.__init__(self)
        cfg = DefaultTrainer.auto_scale_workers(cfg, comm.get_world_size())
        self.cfg = cfg
        model = self.build_model(cfg)
        optimizer = self.build_optimizer(cfg, model)
        model = create_ddp_model(model, broadcast_buffers=False)
        self._trainer = self.build_step_trainer(cfg, model, optimizer)
        self.scheduler = self.build_lr_scheduler(cfg, optimizer)
        self.checkpointer = AtomicCheckpointer(
            unwrap(model), cfg.OUTPUT_DIR, trainer=weakref.proxy(self),
            **self.extra_checkpointables())
        self.start_iter = 0
        self.max_iter = cfg.SOLVER.MAX_ITER
        self.register_hooks(self.build_hooks())

    # -- construction -------------------------------------------------------------------------
    def build_step_trainer(self, cfg, model, optimizer):
        loader = LazyResumableLoader(lambda s: self.build_train_loader(cfg, start_iter=s))
        self._lazy_loaders = [loader]
        return BRAIxStepTrainer(model, loader, optimizer, seed=cfg.SEED)

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
        name = cfg.SOLVER.BRAIXDET.OPTIMIZER.upper()
        if name == "ADAM":  # paper: Adam (stage 1 lr 1e-4 wd 1e-6; stage 2 lr 5e-5 wd 1e-5)
            opt_cls, kwargs = torch.optim.Adam, {"weight_decay": cfg.SOLVER.WEIGHT_DECAY}
        elif name == "SGD":
            opt_cls = torch.optim.SGD
            kwargs = {"momentum": cfg.SOLVER.MOMENTUM, "nesterov": cfg.SOLVER.NESTEROV,
                      "weight_decay": cfg.SOLVER.WEIGHT_DECAY}
        else:
            raise ValueError(f"SOLVER.BRAIXDET.OPTIMIZER must be ADAM or SGD, got {name!r}")
        return maybe_add_gradient_clipping(cfg, opt_cls)(params, lr=cfg.SOLVER.BASE_LR, **kwargs)

    @classmethod
    def build_lr_scheduler(cls, cfg, optimizer):
        return build_lr_scheduler(cfg, optimizer)

    @classmethod
    def build_train_loader(cls, cfg, start_iter=0):
        return build_multiview_train_loader(
            cfg, cfg.DATASETS.TRAIN, cfg.SOLVER.IMS_PER_BATCH, seed=max(cfg.SEED, 0),
            start_iter=start_iter)

    @classmethod
    def build_test_loader(cls, cfg, dataset_name):
        return build_multiview_test_loader(cfg, dataset_name)

    @classmethod
    def build_evaluator(cls, cfg, dataset_name, output_folder=None):
        output_folder = output_folder or os.path.join(cfg.OUTPUT_DIR, "inference", dataset_name)
        return build_evaluator(cfg, dataset_name, output_folder)

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
        for loader in self._lazy_loaders:
            loader.start_iter = self.start_iter

    def build_hooks(self):
        cfg = self.cfg
        ret = [d2_hooks.IterationTimer(), d2_hooks.LRScheduler(),
               d2_hooks.EvalHook(cfg.TEST.EVAL_PERIOD, self._test_and_save_results)]
        ret.extend(self.extra_hooks())  # e.g. ReduceLROnPlateau, which reads the evaluation
        if comm.is_main_process():
            # after evaluation and LR decisions, so a checkpoint holds their outcome (exact resume)
            ret.append(d2_hooks.PeriodicCheckpointer(self.checkpointer,
                                                     cfg.SOLVER.CHECKPOINT_PERIOD))
        if comm.is_main_process():
            ret.append(d2_hooks.PeriodicWriter(self.build_writers(), period=20))
        return ret

    def extra_hooks(self):
        return []

    def _test_and_save_results(self):
        self._last_eval_results = self.test(self.cfg, self.model)
        return self._last_eval_results

    @classmethod
    def test(cls, cfg, model, evaluators=None, prefix=""):
        """Evaluate ``model`` on cfg.DATASETS.TEST; metric keys get ``prefix`` (e.g. student/)."""
        results = {}
        for idx, name in enumerate(cfg.DATASETS.TEST):
            loader = cls.build_test_loader(cfg, name)
            out = os.path.join(cfg.OUTPUT_DIR, "inference", prefix.strip("/") or "model", name)
            evaluator = evaluators[idx] if evaluators else cls.build_evaluator(cfg, name, out)
            res = inference_on_dataset(model, loader, evaluator)
            if comm.is_main_process():
                logger.info("Evaluation results of %s%s:", prefix, name)
                print_csv_format(res)
            results[name] = res
        if len(results) == 1:
            results = next(iter(results.values()))
        if prefix:
            results = {prefix.rstrip("/"): results}
        return results


class MVCCLTrainer(BRAIxTrainerBase):
    """Stage 1: BRAIxMVCCL classifier on D_w ∪ D̃_s, with ReduceLROnPlateau on validation BCE."""

    def extra_hooks(self):
        if not self.cfg.DATASETS.TEST or self.cfg.TEST.EVAL_PERIOD <= 0:
            return []
        names = list(self.cfg.DATASETS.TEST)
        metric = "classification/BCE" if len(names) == 1 else f"{names[0]}/classification/BCE"
        self.plateau = ReduceLROnPlateauHook(
            metric=metric, factor=self.cfg.SOLVER.BRAIXDET.PLATEAU_FACTOR,
            patience=self.cfg.SOLVER.BRAIXDET.PLATEAU_PATIENCE)
        return [self.plateau]


class BRAIxDetTrainer(BRAIxTrainerBase):
    """Stage 2: (multi-view) Faster R-CNN, supervised or student-teacher (cfg.SSL.ENABLED)."""

    def build_step_trainer(self, cfg, model, optimizer):
        if not cfg.SSL.ENABLED:
            return super().build_step_trainer(cfg, model, optimizer)
        self.teacher = build_teacher(model)
        full = LazyResumableLoader(lambda s: build_two_stream_loaders(cfg, start_iter=s)[0])
        weak = LazyResumableLoader(lambda s: build_two_stream_loaders(cfg, start_iter=s)[1])
        self._lazy_loaders = [full, weak]
        use_cam = cfg.SSL.USE_CAM and cfg.SSL.CAM_JSON
        cam_lookup = load_cam_boxes(cfg.SSL.CAM_JSON) if use_cam else {}
        fusion_iters = fusion_iters_from_cfg(
            num_weak_images=_num_images(cfg.DATASETS.TRAIN_WEAK),
            weak_batch_size=cfg.DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH,
            epochs=cfg.SSL.CAM_FUSION_EPOCHS, override_iters=cfg.SSL.CAM_FUSION_ITERS)
        logger.info("Algorithm 2: GradCAM fusion during the first %d iterations", fusion_iters)
        return StudentTeacherStepTrainer(model, self.teacher, full, weak, optimizer, cfg,
                                         cam_lookup, fusion_iters)

    def extra_checkpointables(self):
        return {"teacher": self.teacher} if self.cfg.SSL.ENABLED else {}

    @classmethod
    def build_model(cls, cfg):
        model = super().build_model(cfg)
        if cfg.MODEL.BRAIXDET.INIT_FROM_CLASSIFIER:
            from ..modeling.rcnn import load_classifier_weights_from_cfg

            report = load_classifier_weights_from_cfg(model, cfg)
            logger.info("Initialised from classifier: %d tensors loaded, %d dropped",
                        len(report["loaded"]), len(report["dropped"]))
        return model

    def resume_or_load(self, resume=True):
        super().resume_or_load(resume=resume)
        if self.cfg.SSL.ENABLED and not (resume and self.checkpointer.has_checkpoint()):
            # a fresh run: the teacher starts as a copy of the (initialised) student
            self.teacher.load_state_dict(unwrap(self.model).state_dict())
        if self.cfg.SSL.ENABLED:
            apply_bn_mode(self.model, self.teacher, self.cfg.SSL.BN_MODE)

    def train(self):
        if self.cfg.SSL.ENABLED:
            # TrainerBase.train() calls model.train() nowhere else; keep BN modes after it
            apply_bn_mode(self.model, self.teacher, self.cfg.SSL.BN_MODE)
        results = super().train()
        if self.cfg.SSL.ENABLED and comm.is_main_process():
            # the model users deploy: the teacher alone, loadable by a plain build_model +
            # DetectionCheckpointer (tools/predict.py, --eval-only)
            export_model_only(self.teacher,
                              os.path.join(self.cfg.OUTPUT_DIR, "model_final_teacher.pth"))
        return results

    def _test_and_save_results(self):
        if not self.cfg.SSL.ENABLED:
            return super()._test_and_save_results()
        results = self.test(self.cfg, self.teacher)  # the teacher is the model we report
        if self.cfg.TEST.BRAIXDET.EVAL_STUDENT:
            results = dict(results)
            results.update(self.test(self.cfg, unwrap(self.model), prefix="student/"))
            self.model.train()
            apply_bn_mode(self.model, self.teacher, self.cfg.SSL.BN_MODE)
        self._last_eval_results = results
        return results


def _num_images(dataset_names):
    from detectron2.data import DatasetCatalog

    return sum(len(DatasetCatalog.get(n)) for n in dataset_names)


def trainer_class(cfg):
    """The trainer for the config's meta-architecture (classifier: stage 1; else stage 2)."""
    return MVCCLTrainer if cfg.MODEL.META_ARCHITECTURE == "MVCCLClassifier" else BRAIxDetTrainer


__all__ = ["MVCCLTrainer", "BRAIxDetTrainer", "trainer_class"]
