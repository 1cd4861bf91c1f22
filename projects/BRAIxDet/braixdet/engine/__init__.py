from .predictor import ExamPredictor, ImagePrediction
from .trainers import BRAIxDetTrainer, MVCCLTrainer, trainer_class

__all__ = ["BRAIxDetTrainer", "ExamPredictor", "ImagePrediction", "MVCCLTrainer",
           "trainer_class"]
