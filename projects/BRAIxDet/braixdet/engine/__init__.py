"""Trainers, the exam predictor and training set-up; ``trainer_class(cfg)`` picks the trainer."""
from .predictor import ExamPredictor, ImagePrediction
from .trainers import BRAIxDetTrainer, MVCCLTrainer, StudentTeacherTrainer, trainer_class

__all__ = ["BRAIxDetTrainer", "ExamPredictor", "ImagePrediction", "MVCCLTrainer",
           "StudentTeacherTrainer", "trainer_class"]
