"""BRAIxDet's config keys and their defaults, added to a detectron2 config by
``add_braixdet_config(cfg)``; which values each key accepts is in checks.py.

Paper defaults (BRAIxDet, §4.3) are the defaults here; demo/test configs shrink sizes.
"""
from detectron2.config import CfgNode as CN

# Paper §4.3: 20 epochs per stage; Algorithm 2 fuses the GradCAM boxes in the first 2 of them
PAPER_EPOCHS = 20.0
PAPER_CAM_FUSION_EPOCHS = 2.0


def add_braixdet_config(cfg):
    """Add every key BRAIxDet reads. Call once on a fresh `get_cfg()` before merging files."""
    # torch intra-op threads of every stage process (utils/runtime.py): the numbers depend on
    # it; 0 = torch's default (the machine's cores: other machines, other numbers)
    cfg.NUM_THREADS = 0
    _set_unsupported_defaults(cfg)
    _add_model_config(cfg)
    _add_input_config(cfg)
    _add_dataset_config(cfg)
    _add_solver_config(cfg)
    _add_ssl_config(cfg)
    _add_test_config(cfg)
    return cfg


def _add_model_config(cfg):
    # grey images in [0, 1] (canonical cache), normalised as the pretrained weights expect:
    # the mean of timm's RGB mean / std for TIMM_MODEL (checked when PRETRAINED is set)
    cfg.MODEL.PIXEL_MEAN = [0.449]
    cfg.MODEL.PIXEL_STD = [0.226]
    b = cfg.MODEL.BRAIXDET = CN()
    b.TIMM_MODEL = "efficientnet_b0"  # any timm model with features_only (paper: EfficientNet-b0)
    # Encoder init (paper: ImageNet). "imagenet" = timm's weights from the hub (internet once);
    # "efficientnet-lite0-package" = offline ImageNet weights from the package index (with
    # TIMM_MODEL tf_efficientnet_lite0, PIXEL_MEAN/STD [0.5]); a local weights file; "" = random.
    # Not used when MODEL.WEIGHTS or INIT_FROM_CLASSIFIER (detector) provides the encoder.
    b.PRETRAINED = "imagenet"
    b.IN_CHANS = 1  # grey input; timm adapts the stem (sums RGB kernels) when pretrained
    # Recompute encoder activations in backward (timm set_grad_checkpointing): less GPU memory
    # at the paper's batch for ~30% more step time (smaller cards; see docs/DESIGN.md §4a)
    b.GRAD_CHECKPOINTING = False
    # Encoder in channels-last (NHWC) memory layout: the same model up to float rounding, and
    # oneDNN's NHWC depthwise convolutions make the demo's stage steps 1.3-2.2x faster on a
    # CPU (docs/RESULTS.md §1.10; not measured on a GPU). False: NCHW, as before 2026-12-07.
    b.CHANNELS_LAST = True
    # timm feature stages exposed as res2..res5 (strides 4, 8, 16, 32)
    b.OUT_FEATURES = ["res3", "res4", "res5"]
    b.MULTI_VIEW = True  # False: single-view model (the Faster R-CNN baseline)
    b.ROI_FOCAL_GAMMA = 1.5  # focal loss γ of ROI_HEADS.NAME FocalLossROIHeads (Unbiased Teacher)
    # Local co-occurrence module (cross-view attention on the stride-32 features)
    b.LCM = CN()
    b.LCM.ENABLED = True
    b.LCM.EMBED_DIM = 128  # d: attention width
    b.LCM.NUM_HEADS = 4
    b.LCM.OUT_DIM = 128  # D': channels of f_l(u_m, u_a) before concatenation with u_m
    b.LCM.DROPOUT = 0.0
    # The fuse conv starts as identity on u plus cross-view weights of std GAIN/sqrt(D') (see
    # modeling/lcm.py), and the LCM learns at BASE_LR * LR_FACTOR: options for the cross-view
    # path that stays at its initial scale (docs/RESULTS.md §24-§25); the defaults are the
    # original reconstruction
    b.LCM.CROSS_VIEW_INIT_GAIN = 0.1
    b.LCM.LR_FACTOR = 1.0
    # Finer encoder stages (e.g. ["res4"]) that get a main <- aux attention of their own in the
    # multi-view detector, whose ROI pooler and RPN find small lesions there (RESULTS §25)
    b.LCM.EXTRA_FEATURES = []
    # Multi-view detector: add a linear map (zero at the start) of [max, mean] of the aux
    # view's res5 features to every FPN level, the global path the BRAIxMVCCL head reads its
    # second view through and the paper's detector drops (modeling/backbone.py AuxGlobalFPN;
    # RESULTS §26). Not in the paper: off by default
    b.DET_READS_AUX_GLOBAL = False
    # Detector: weight of an image-level BCE on the image label, from a head (the classifier
    # head's shape) on [max, mean] of the fused res5 features ũ_m, so the detector has a reason
    # to read its second view through the LCM (modeling/rcnn.py; RESULTS §29). The head starts
    # as the stage-1 classifier's where that head reads the same summary (CLS_HEAD_READS_AUX
    # False, or a single-view classifier). 0 = off, the paper
    b.DET_IMAGE_LOSS_WEIGHT = 0.0
    # Global consistency module (classifier only)
    b.GCM = CN()
    b.GCM.ENABLED = True
    b.GCM.LOSS_WEIGHT = 1.0
    # Classifier head (MVCCL)
    # False: the head reads [max, GAP] of the LCM's main output only, so the second view reaches
    # the logit through the LCM alone (needs GCM.ENABLED False; RESULTS §25's diagnostic of an
    # LCM the paper's head, which also reads the aux view directly, leaves untrained)
    b.CLS_HEAD_READS_AUX = True
    b.CLS_HIDDEN_DIM = 256
    b.CLS_DROPOUT = 0.0
    # Algorithm 1 (GradCAM pseudo-boxes): threshold τ and component-area limits, given in
    # pixels at REF_SIZE and scaled with the canonical input size
    b.CAM = CN()
    # Paper: GradCAM at the last stage (res5 = the main view's encoder features u_m). "layercam" at
    # "res4" (stride 16) localises far better when lesions span less than ~2 stride-32 cells
    # (small inputs); see docs/DESIGN.md §3.5.
    b.CAM.METHOD = "gradcam"  # gradcam | layercam
    b.CAM.TARGET_LAYER = "res5"  # res5 | res4 | res3 | res3+res4+res5 (normalised mean of the 3)
    b.CAM.TAU = 0.5
    b.CAM.MIN_AREA = 32**2
    b.CAM.MAX_AREA = 1024**2
    b.CAM.REF_SIZE = (1536, 768)
    # Stage-1 checkpoint whose backbone + LCM initialise the detector ("" = none)
    b.INIT_FROM_CLASSIFIER = ""
    # FPN on top of the timm features for the detector
    cfg.MODEL.FPN.IN_FEATURES = ["res3", "res4", "res5"]
    cfg.MODEL.FPN.OUT_CHANNELS = 128


def _add_input_config(cfg):
    i = cfg.INPUT.BRAIXDET = CN()
    i.CANONICAL_SIZE = (1536, 768)  # (H, W) after crop, pad to H/W=2 and resize (paper §4.3)
    i.MASK_MARGIN = 0.02  # crop margin around the breast mask, fraction of the mask's box
    i.MASK_DOWNSAMPLE = 8  # mask is found on a downsampled, blurred image (speed, robustness)
    i.CACHE_DIR = ""  # "" = <OUTPUT_DIR>/../cache; never inside the dataset root
    i.CACHE_FORMAT = "npy"  # npy (raw uint16, fastest hits) | png (16-bit, ~3x smaller)
    i.ALLOW_FOR_PROCESSING = False  # refuse PresentationIntentType "FOR PROCESSING"
    # Augmentation (paper: no cutout / colour jitter). Probabilities and ranges.
    i.AUG = CN()
    i.AUG.ENABLED = True
    i.AUG.VFLIP_PROB = 0.5  # vertical flip keeps the nipple on the right
    i.AUG.BRIGHTNESS = 0.1  # mild intensity scaling range (±)
    i.AUG.CONTRAST = 0.1


def _add_dataset_config(cfg):
    d = cfg.DATASETS.BRAIXDET = CN()
    d.FORMAT = "cbis_ddsm"  # cbis_ddsm | vindr_mammo | exam_csv
    d.ROOT = ""  # dataset root; read only
    d.CSV = ""  # exam_csv: the CSV file (relative to ROOT or absolute)
    d.NAME = ""  # registered name prefix; "" = FORMAT
    d.PROTOCOL = "partial"  # partial | full
    # partially labelled ratio of annotated images kept as boxes; "1/8" or 0.125, recorded as
    # "p/q" by build_cfg
    d.RATIO = "1/8"
    d.SEED = 0  # split seed: same seed -> same split everywhere
    d.VAL_FRACTION = 0.1  # patient-wise train/val split (val: fully annotated images only)
    # A validation split without a lesion has no AP/AUC to select a model or drive the plateau
    # schedule: refused before training unless this is True (then the last model is exported)
    d.ALLOW_LESION_FREE_VAL = False
    # detection test set (data/protocols.py): "paper" = the fully annotated cancer images only
    # (paper §4.1, for ADMANI; on CBIS-DDSM our extrapolation; configs/Base-*.yaml); "full" =
    # every fully annotated test image, lesion-free ones included; "full+negatives" also scores
    # weak label-0 images as lesion-free
    d.TEST_IMAGES = "full"
    # where split JSONs and bad-input reports go; "" = <OUTPUT_DIR>/splits (set by build_cfg)
    d.SPLIT_DIR = ""
    d.ON_BAD_INPUT = "skip"  # skip (report and continue) | error
    d.VINDR_MALIGNANT_BIRADS = [4, 5]
    cfg.DATASETS.TRAIN_WEAK = ()  # weak stream (stage 2); filled from the protocol when empty
    cfg.DATALOADER.BRAIXDET = CN()
    cfg.DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH = 4  # global batch of the weak stream


def _add_solver_config(cfg):
    s = cfg.SOLVER.BRAIXDET = CN()
    s.OPTIMIZER = "ADAM"  # ADAM | SGD
    # Schedule in epochs (paper: 20 per stage; see config/schedule.py): used where MAX_ITER <= 0;
    # TEST.EVAL_PERIOD < 0 and CHECKPOINT_PERIOD <= 0 mean once per epoch. resolve_cfg writes
    # the iterations in, so a run's config.yaml records what ran
    s.EPOCHS = PAPER_EPOCHS
    cfg.SOLVER.MAX_ITER = -1
    cfg.SOLVER.CHECKPOINT_PERIOD = -1
    # periodic checkpoints kept on disk, the newest (0 = all, detectron2's default): resume reads
    # only the last, the export and model_final are separate files; a 20-epoch stage-2 run keeps
    # ~2.4 GB otherwise
    s.CHECKPOINTS_KEPT = 1
    cfg.TEST.EVAL_PERIOD = -1
    # ReduceLROnPlateau (paper: x0.1) on a validation metric, which also selects the exported
    # detector; "" = stage default (stage 1 classification/BCE, stage 2 bbox/AP20). Stage 2 can
    # follow the paper's "BCE loss during model validation" with "screening/image_BCE" (BCE of
    # the max detection score against the image label); a name with "bce"/"loss" is minimised
    s.PLATEAU_FACTOR = 0.1
    s.PLATEAU_PATIENCE = 2  # evaluations without improvement
    s.PLATEAU_METRIC = ""
    s.CHECK_FINITE = True  # stop with an error naming the iteration and loss term on NaN/inf
    # SOLVER.AMP.ENABLED (detectron2's key) trains in mixed precision: "auto" = bf16 where
    # supported (CPU, Ampere+ GPUs), else fp16 with a gradient scaler
    s.AMP_DTYPE = "auto"


def _add_ssl_config(cfg):
    s = cfg.SSL = CN()
    s.ENABLED = False
    s.LAMBDA_WEAK = 0.25  # λ in ℓ_stu = ℓ_sup + λ ℓ_wek (paper eq. 5)
    s.EMA_ALPHA = 0.999
    # momentum min(EMA_ALPHA, 1 - 1/(t+2)) after iteration t (Soft Teacher's official ramp)
    s.EMA_RAMP = False
    s.BN_MODE = "frozen"  # frozen | open | ema
    s.USE_CAM = True  # Algorithm 2: fuse GradCAM boxes with the teacher's early on
    s.CAM_JSON = ""  # output of tools/gradcam_pseudo_labels.py
    # the boxes Algorithm 2 fuses (ssl/box_sources.py): "gradcam" = CAM_JSON (the paper);
    # "oracle" = D_w's true cancer boxes (upper bound); "random" = boxes at random inside the
    # breast with the true boxes' count and sizes, seeded by SEED (lower bound)
    s.CAM_BOX_SOURCE = "gradcam"
    # log precision/recall of D_w's teacher, CAM-source and fused pseudo-boxes against the
    # boxes the protocol withheld (ssl/pseudo_quality.py); logging only, never training
    s.PSEUDO_QUALITY = False
    # View agreement (our choice; 0 = off, the paper): keep a CAM box only if the other view's
    # map exceeds τ within ± this fraction of the breast's depth from the nipple (cam.py)
    s.CAM_VIEW_AGREEMENT = 0.0
    s.CAM_FUSION_EPOCHS = PAPER_CAM_FUSION_EPOCHS  # epochs of D_w with fusion (paper: 2)
    s.CAM_FUSION_ITERS = -1  # >= 0 overrides CAM_FUSION_EPOCHS, in iterations
    s.PSEUDO_NMS_THRESH = 0.2  # τ_nms when fusing teacher and CAM boxes
    s.NEGATIVE_AS_BACKGROUND = True  # weak label-0 images train as all-background
    s.TEACHER_SCORE_THRESH = 0.0  # minimal score of the teacher's top-1 box
    # competitors (ssl/competitors.py): "top1" = Algorithm 2; "threshold" = every teacher box
    # with score >= TEACHER_SCORE_THRESH (Unbiased Teacher 0.7, STAC 0.9, Soft Teacher 0.5)
    s.PSEUDO_LABELS = "top1"
    # threshold capped at the image's best teacher score: every image keeps its top box (STAC)
    s.PSEUDO_KEEP_TOP = False
    s.STRONG_AUG = False  # the student's copy of weak images strongly augmented (UT, ST)
    # which strong augmentation: "affine" (ours), "stac" (STAC's and Soft Teacher's policy),
    # "unbiased_teacher" (photometric only)
    s.STRONG_AUG_POLICY = "affine"
    # labelled images trained on a strongly augmented copy too (Unbiased Teacher)
    s.STRONG_AUG_LABELLED = False
    s.UNSUP_LOSSES = []  # loss terms kept on pseudo-labelled images; empty = all
    s.BURN_IN_ITERS = 0  # supervised-only iterations, teacher = student copy (UT burn-in)
    # Soft Teacher (ssl/soft_teacher.py): background-weighted classification, box jittering
    s.SOFT_TEACHER = False
    # pseudo-boxes (>= this) for the RPN and classification; TEACHER_SCORE_THRESH (0.5) is the
    # candidate set whose reliable boxes train regression
    s.SOFT_TEACHER_CLS_THRESH = 0.9
    s.JITTER_TIMES = 10  # jittered copies per pseudo-box
    s.JITTER_SCALE = 0.06  # jitter std as a fraction of the box's side
    s.REG_UNCERTAINTY_THRESH = 0.02  # box regression only below this jitter uncertainty
    # a detector export that the teacher starts from instead of the student (STAC: the
    # supervised detector; with EMA_ALPHA 1.0 it stays fixed, i.e. labels D_w once)
    s.TEACHER_WEIGHTS = ""


def _add_test_config(cfg):
    t = cfg.TEST.BRAIXDET = CN()
    t.IOU_THRESH = 0.2
    t.FROC_FPPI = [0.25, 0.5, 1.0, 2.0, 4.0]
    t.CENTER_HIT = False  # FROC option: detection centre inside the GT box counts as a hit
    t.SAVE_PLOTS = True
    t.EVAL_STUDENT = True  # also evaluate the student (metrics prefixed with student/)
    # each box's score × the top score of its paired view (exam_scores.paired_view_rescore), in
    # evaluation and inference alike; off as the paper scores (docs/RESULTS.md §26-27)
    t.PAIRED_VIEW_RESCORE = False
    # each box's score × the detector's own image probability (the DET_IMAGE_LOSS_WEIGHT head),
    # in evaluation and inference alike; the SSL teacher's pseudo-labels read the unscaled
    # scores. Off: not in the paper
    t.IMAGE_SCORE_GATE = False


# detectron2 keys our data path and trainers do not implement, each with its neutral value (the
# one our code behaves like) and what to use instead. A config that changes one is refused:
# a key that silently does nothing is a bug. INPUT sizes/flips are INPUT.BRAIXDET.* here.
UNSUPPORTED_KEYS = {
    "TEST.PRECISE_BN.ENABLED": (False, "BN statistics come from pre-training (SSL.BN_MODE)"),
    "TEST.AUG.ENABLED": (False, "test-time augmentation is not implemented"),
    "DATALOADER.SAMPLER_TRAIN": ("TrainingSampler", "the loaders draw seeded, resumable "
                                 "permutations (data/build.py)"),
    "DATALOADER.ASPECT_RATIO_GROUPING": (False, "every canonical image has one size"),
    "DATALOADER.FILTER_EMPTY_ANNOTATIONS": (False, "lesion-free images are training data"),
    "MODEL.MASK_ON": (False, "boxes only"),
    "MODEL.KEYPOINT_ON": (False, "boxes only"),
    "MODEL.LOAD_PROPOSALS": (False, "proposals come from the RPN"),
    "MODEL.BACKBONE.FREEZE_AT": (0, "the timm encoder trains every stage"),
    "DATASETS.PROPOSAL_FILES_TRAIN": ((), "proposals come from the RPN"),
    "DATASETS.PROPOSAL_FILES_TEST": ((), "proposals come from the RPN"),
}
# detectron2 INPUT keys our data path does not read (images are canonicalised by
# INPUT.BRAIXDET.*): a config that changes one from detectron2's default is refused
D2_INPUT_KEYS = ("MIN_SIZE_TRAIN", "MIN_SIZE_TRAIN_SAMPLING", "MAX_SIZE_TRAIN", "MIN_SIZE_TEST",
                 "MAX_SIZE_TEST", "RANDOM_FLIP", "FORMAT", "CROP.ENABLED")


def _get(cfg, key):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def _set_unsupported_defaults(cfg):
    for key, (value, _) in UNSUPPORTED_KEYS.items():
        node, _, leaf = key.rpartition(".")
        _get(cfg, node)[leaf] = value
