"""Orchestration of whole experiments: the method table, the two-stage pipeline (one stage per
child process, resumable), seed summaries and the demo. tools/run_pipeline.py,
run_experiments.py and run_demo.py only parse arguments and call this package."""
from .core import Pipeline, add_pipeline_arguments
from .methods import CAM_ONLY, METHODS, STAGE1, Method, method_order
from .stages import StageFailed, StageInterrupted

__all__ = ["Pipeline", "add_pipeline_arguments", "METHODS", "STAGE1", "Method", "CAM_ONLY",
           "method_order", "StageFailed", "StageInterrupted"]
