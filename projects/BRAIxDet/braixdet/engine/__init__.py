from .trainers import BRAIxDetTrainer, MVCCLTrainer, trainer_class

__all__ = ["BRAIxDetTrainer", "MVCCLTrainer", "trainer_class"]
