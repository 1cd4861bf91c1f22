"""Tiny configs shared by tests (random init, 128x64 inputs, small widths)."""
from detectron2.config import get_cfg

from braixdet.config import add_braixdet_config


def tiny_cfg(meta_arch: str = "MultiViewRCNN", multi_view: bool = True):
    """A CPU config that builds in ~1 s: efficientnet_b0 random init, FPN 32, LCM 32, 1 class.

    FPN over res3..res5 gives p3..p6 (strides 8..64); anchors/RPN/ROI heads use those 4 levels.
    """
    cfg = get_cfg()
    add_braixdet_config(cfg)
    cfg.MODEL.DEVICE = "cpu"
    cfg.MODEL.META_ARCHITECTURE = meta_arch
    cfg.MODEL.BACKBONE.NAME = "build_braixdet_fpn_backbone"
    cfg.MODEL.BRAIXDET.TIMM_MODEL = "efficientnet_b0"
    cfg.MODEL.BRAIXDET.PRETRAINED = ""
    cfg.MODEL.BRAIXDET.MULTI_VIEW = multi_view
    cfg.MODEL.BRAIXDET.OUT_FEATURES = ["res3", "res4", "res5"]
    cfg.MODEL.BRAIXDET.LCM.EMBED_DIM = 32
    cfg.MODEL.BRAIXDET.LCM.OUT_DIM = 32
    cfg.MODEL.BRAIXDET.LCM.NUM_HEADS = 4
    cfg.MODEL.BRAIXDET.CLS_HIDDEN_DIM = 32
    cfg.MODEL.FPN.IN_FEATURES = ["res3", "res4", "res5"]
    cfg.MODEL.FPN.OUT_CHANNELS = 32
    levels = ["p3", "p4", "p5", "p6"]
    cfg.MODEL.ANCHOR_GENERATOR.SIZES = [[16], [32], [64], [128]]
    cfg.MODEL.ANCHOR_GENERATOR.ASPECT_RATIOS = [[0.5, 1.0, 2.0]]
    cfg.MODEL.RPN.IN_FEATURES = levels
    cfg.MODEL.RPN.PRE_NMS_TOPK_TRAIN = 200
    cfg.MODEL.RPN.POST_NMS_TOPK_TRAIN = 50
    cfg.MODEL.RPN.PRE_NMS_TOPK_TEST = 200
    cfg.MODEL.RPN.POST_NMS_TOPK_TEST = 50
    cfg.MODEL.RPN.BATCH_SIZE_PER_IMAGE = 64
    cfg.MODEL.ROI_HEADS.NAME = "StandardROIHeads"
    cfg.MODEL.ROI_HEADS.IN_FEATURES = levels
    cfg.MODEL.ROI_HEADS.NUM_CLASSES = 1
    cfg.MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE = 32
    cfg.MODEL.ROI_HEADS.IOU_THRESHOLDS = [0.2]  # paper: ROI foreground IoU 0.2
    cfg.MODEL.ROI_HEADS.NMS_THRESH_TEST = 0.2  # paper: test NMS 0.2
    cfg.MODEL.ROI_HEADS.SCORE_THRESH_TEST = 0.0
    cfg.MODEL.ROI_BOX_HEAD.NAME = "FastRCNNConvFCHead"
    cfg.MODEL.ROI_BOX_HEAD.NUM_FC = 1
    cfg.MODEL.ROI_BOX_HEAD.FC_DIM = 64
    cfg.MODEL.ROI_BOX_HEAD.POOLER_RESOLUTION = 7
    cfg.TEST.DETECTIONS_PER_IMAGE = 20
    return cfg


def tiny_classifier_cfg(multi_view: bool = True):
    return tiny_cfg("MVCCLClassifier", multi_view=multi_view)
