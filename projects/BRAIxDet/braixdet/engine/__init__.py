"""Training: trainers, hooks, checkpoints, schedule and set-up; ``trainer_class(cfg)`` picks the
trainer. Inference is ``braixdet.inference``."""
from .trainers import BRAIxDetTrainer, MVCCLTrainer, StudentTeacherTrainer, trainer_class

__all__ = ["BRAIxDetTrainer", "MVCCLTrainer", "StudentTeacherTrainer", "trainer_class"]
