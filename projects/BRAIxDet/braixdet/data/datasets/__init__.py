"""Dataset loaders: each returns BRAIxDet dataset dicts (docs/DESIGN.md §2) with views paired."""
from .cbis_ddsm import load_cbis_ddsm
from .exam_csv import load_exam_csv
from .vindr_mammo import load_vindr_mammo

LOADERS = {"cbis_ddsm": load_cbis_ddsm, "vindr_mammo": load_vindr_mammo, "exam_csv": load_exam_csv}

__all__ = ["load_cbis_ddsm", "load_exam_csv", "load_vindr_mammo", "LOADERS"]
