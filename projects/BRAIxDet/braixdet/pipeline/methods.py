"""The rows a pipeline run can produce (paper Table 6 and the competitors), one entry each.

Adding a method is adding an entry to ``METHODS``: the pipeline trains the stage-1 model it
starts from (``init``), the GradCAM pseudo-boxes when ``cam`` is set, and first the method named
by ``teacher_from`` when the entry needs another method's exported model (e.g. STAC labels D_w
with a first detector), passing that model's path as the config key ``teacher_key``.
"""
from dataclasses import dataclass
from typing import Optional

# stage-1 classifiers: name -> config (relative to the config root: configs/ or configs/demo/)
STAGE1 = {"mvccl": "MVCCL/mvccl.yaml",
          "classifier_single_view": "MVCCL/single_view_classifier.yaml"}


# δ of the view-agreement row: chosen on development set A's hit rates; on set B it gave no
# measurable detector gain (docs/RESULTS.md §2.3), so no config turns it on
VIEW_AGREEMENT = 0.1


# SSL.CAM_FUSION_ITERS beyond any schedule: Algorithm 2's fusion at every iteration
WHOLE_SCHEDULE = 10 ** 9


@dataclass(frozen=True)
class Method:
    label: str  # the row of the results table
    config: str  # relative to the config root (configs/ or configs/demo/)
    init: str  # the stage-1 model it starts from: a key of STAGE1
    cam: bool = False  # reads the GradCAM pseudo-boxes (Algorithm 2): SSL.CAM_JSON
    teacher_from: Optional[str] = None  # a key of METHODS whose exported model this one needs
    teacher_key: str = ""  # the config key that receives that model's path
    opts: tuple = ()  # fixed config overrides of this row (KEY, VALUE, ...)

    def __post_init__(self):
        if self.init not in STAGE1:
            raise ValueError(f"{self.label}: init {self.init!r} is not one of {sorted(STAGE1)}")
        if bool(self.teacher_from) != bool(self.teacher_key):
            raise ValueError(f"{self.label}: teacher_from and teacher_key go together")


# paper Table 6 rows; "cam_only" (row 1) scores the GradCAM boxes themselves
METHODS = {
    "faster_rcnn": Method("Faster R-CNN", "baselines/faster_rcnn.yaml",
                          "classifier_single_view"),
    "faster_rcnn_mv": Method("Faster R-CNN + MV", "baselines/faster_rcnn_multiview.yaml",
                             "mvccl"),
    "ssl_single_view": Method("SSL (single view)", "baselines/ssl_single_view.yaml",
                              "classifier_single_view"),
    "mean_teacher": Method("MV + SSL (Mean Teacher)", "baselines/mean_teacher_multiview.yaml",
                           "mvccl"),
    "braixdet": Method("BRAIxDet", "BRAIxDet/braixdet.yaml", "mvccl", cam=True),
    # our option (issue 20): GradCAM boxes only where the other view's map agrees in depth
    "braixdet_view_agreement": Method("BRAIxDet + view agreement", "BRAIxDet/braixdet.yaml",
                                      "mvccl", cam=True,
                                      opts=("SSL.CAM_VIEW_AGREEMENT", str(VIEW_AGREEMENT))),
    # Algorithm 2's bounds (issue 27): the fusion fed with D_w's true cancer boxes (upper) or
    # with random boxes inside the breast (lower) instead of GradCAM's (ssl/box_sources.py)
    "braixdet_oracle_boxes": Method("BRAIxDet, oracle boxes", "BRAIxDet/braixdet.yaml", "mvccl",
                                    opts=("SSL.CAM_BOX_SOURCE", "oracle", "SSL.CAM_JSON", "")),
    "braixdet_random_boxes": Method("BRAIxDet, random boxes", "BRAIxDet/braixdet.yaml", "mvccl",
                                    opts=("SSL.CAM_BOX_SOURCE", "random", "SSL.CAM_JSON", "")),
    # the oracle fused at every iteration, not only in the paper's first 2 of 20 epochs: says
    # whether Algorithm 2's window is what keeps true boxes from helping (RESULTS §16)
    "braixdet_oracle_boxes_whole_schedule": Method(
        "BRAIxDet, oracle boxes, whole schedule", "BRAIxDet/braixdet.yaml", "mvccl",
        opts=("SSL.CAM_BOX_SOURCE", "oracle", "SSL.CAM_JSON", "", "SSL.CAM_FUSION_ITERS",
              str(WHOLE_SCHEDULE))),
    # GradCAM's boxes (Algorithm 1) fused at every iteration: whether the boxes the method has
    # carry part of what true boxes gain from a longer window (RESULTS §17); diagnostic only
    "braixdet_whole_schedule": Method(
        "BRAIxDet, whole schedule", "BRAIxDet/braixdet.yaml", "mvccl", cam=True,
        opts=("SSL.CAM_FUSION_ITERS", str(WHOLE_SCHEDULE))),
    # where the multi-view cost comes from (issue 27, RESULTS §15): each detector started from
    # the other stage-1 classifier (unmatched modules dropped or trained from scratch)
    "faster_rcnn_mv_sv_init": Method("Faster R-CNN + MV, single-view classifier init",
                                     "baselines/faster_rcnn_multiview.yaml",
                                     "classifier_single_view"),
    "faster_rcnn_mvccl_init": Method("Faster R-CNN, BRAIxMVCCL init", "baselines/faster_rcnn.yaml",
                                     "mvccl"),
    # competitors of the paper's Tables 2-4 (single view, issue 22)
    "unbiased_teacher": Method("Unbiased Teacher", "baselines/unbiased_teacher.yaml",
                               "classifier_single_view"),
    "stac": Method("STAC", "baselines/stac.yaml", "classifier_single_view",
                   teacher_from="faster_rcnn", teacher_key="SSL.TEACHER_WEIGHTS"),
    "soft_teacher": Method("Soft Teacher", "baselines/soft_teacher.yaml",
                           "classifier_single_view"),
}
CAM_ONLY = "cam_only"
PAPER_CAM = ("gradcam", "res5")
# docs/RESULTS.md §2 (which heatmap localises): LayerCAM res4 found the lesions GradCAM res5
# missed
LOCALISING_CAM = ("layercam", "res4")


def method_order(keys):
    """``keys`` plus the methods they depend on (teacher_from), dependencies first."""
    order = []

    def visit(key, path=()):
        if key in path:
            raise ValueError(f"methods depend on each other in a cycle: {' -> '.join(path)}")
        m = METHODS[key]
        if m.teacher_from:
            visit(m.teacher_from, path + (key,))
        if key not in order:
            order.append(key)

    for k in keys:
        if k in METHODS:
            visit(k)
    return order
