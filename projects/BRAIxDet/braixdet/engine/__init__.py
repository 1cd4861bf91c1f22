from .trainers import BRAIxDetTrainer, MVCCLTrainer, build_trainer, trainer_class

__all__ = ["BRAIxDetTrainer", "MVCCLTrainer", "build_trainer", "trainer_class"]
