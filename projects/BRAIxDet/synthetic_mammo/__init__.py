"""Synthetic screening-mammography datasets in the real CBIS-DDSM on-disk layout (tests, demo).

Not part of braixdet: test and demo tooling. plan.py decides patients, splits and lesions,
render.py draws the pixels, write.py writes the DICOMs and CSVs (layout and upstream quirks are
described there), regimes.py names harder settings for benchmarks. Deterministic from ``seed``,
with one exception noted in write.py.
"""
from .regimes import REGIMES, regime
from .write import CALC_HEADER, EXAM_HEADER, MASS_HEADER, make_synthetic_dataset

__all__ = ["make_synthetic_dataset", "MASS_HEADER", "CALC_HEADER", "EXAM_HEADER", "REGIMES",
           "regime"]
