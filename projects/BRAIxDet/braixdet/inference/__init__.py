"""Inference on DICOM exams: the predictor (``ExamPredictor``), what tools/predict.py writes
(``predict_to_folder``: predictions.json, overlays, DICOM SR and presentation states), the SR /
presentation-state builders, their de-identification and the one drawing module."""
from .outputs import FORMATS, predict_to_folder
from .predictor import ExamPredictor, ImagePrediction

__all__ = ["FORMATS", "ExamPredictor", "ImagePrediction", "predict_to_folder"]
