"""Tiny training runs shared by test_train_stages.py and test_reliability.py.

Every run uses the demo configs shrunk to 128x64 canonical images, batch 2, narrow heads and
NUM_WORKERS 0, so a few iterations take seconds on 2 shared CPU cores. Outputs, splits and the
canonical cache always go to temporary folders: the dataset root is read only.
"""
import json
import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_NET = os.path.join(REPO, "tools", "train_net.py")
GRADCAM = os.path.join(REPO, "tools", "gradcam_pseudo_labels.py")
CONFIGS = {
    "mvccl": os.path.join(REPO, "configs", "demo", "MVCCL", "mvccl.yaml"),
    "braixdet": os.path.join(REPO, "configs", "demo", "BRAIxDet", "braixdet.yaml"),
    "faster_rcnn": os.path.join(REPO, "configs", "demo", "baselines", "faster_rcnn.yaml"),
}
# the stages whose config builds an LCM (the competitors' configs are single-view)
MULTI_VIEW_STAGES = ("mvccl", "braixdet")

# the tiny detectors' proposal budget: a detector sends every top-k proposal to the ROI heads,
# and with random weights nearly all survive NMS; 50 keep a CPU step short
FEW_PROPOSALS = ["MODEL.RPN.PRE_NMS_TOPK_TRAIN", "200", "MODEL.RPN.POST_NMS_TOPK_TRAIN", "50",
                 "MODEL.RPN.PRE_NMS_TOPK_TEST", "200", "MODEL.RPN.POST_NMS_TOPK_TEST", "50",
                 "MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE", "32"]

def tiny_opts(root, out, cache_dir, stage="braixdet", max_iter=4, ckpt_period=100,
              eval_period=0, init_from="", cam_json="", cam_iters=-1, extra=()):
    """Config overrides (KEY VALUE list) for a tiny run of ``stage`` (a CONFIGS key).

    ``cache_dir`` is shared between runs of a module (the canonical cache is keyed by file path,
    mtime and preprocessing parameters, so sharing it only saves time).
    """
    opts = [
        "OUTPUT_DIR", str(out),
        "DATASETS.BRAIXDET.ROOT", str(root),
        "DATASETS.BRAIXDET.SPLIT_DIR", os.path.join(str(out), "splits"),
        "INPUT.BRAIXDET.CACHE_DIR", str(cache_dir),
        "INPUT.BRAIXDET.CANONICAL_SIZE", "(128, 64)",
        "DATALOADER.NUM_WORKERS", "0",
        "SOLVER.IMS_PER_BATCH", "2",
        "SOLVER.MAX_ITER", str(max_iter),
        "SOLVER.WARMUP_ITERS", "2",
        "SOLVER.CHECKPOINT_PERIOD", str(ckpt_period),
        "TEST.EVAL_PERIOD", str(eval_period),
        "SEED", "7",
    ]
    extra = [str(x) for x in extra]
    if stage in MULTI_VIEW_STAGES and ["MODEL.BRAIXDET.MULTI_VIEW", "False"] not in [
            extra[i:i + 2] for i in range(0, len(extra), 2)]:
        # only where the model builds an LCM: training refuses LCM keys elsewhere
        opts += ["MODEL.BRAIXDET.LCM.EMBED_DIM", "32", "MODEL.BRAIXDET.LCM.OUT_DIM", "32"]
    if stage == "mvccl":
        opts += ["MODEL.BRAIXDET.CLS_HIDDEN_DIM", "32"]
    else:
        opts += [
            "DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH", "2",
            "MODEL.FPN.OUT_CHANNELS", "32",
            *FEW_PROPOSALS,
            "MODEL.RPN.BATCH_SIZE_PER_IMAGE", "64",
            "MODEL.ROI_BOX_HEAD.FC_DIM", "64",
            "TEST.DETECTIONS_PER_IMAGE", "20",
            "TEST.BRAIXDET.SAVE_PLOTS", "False",
            "MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", str(init_from),
        ]
    if stage == "braixdet":
        # a fast-moving teacher (alpha 0.5) makes the EMA relation visible in a few steps
        opts += ["SSL.CAM_JSON", str(cam_json), "SSL.CAM_FUSION_ITERS", str(cam_iters),
                 "SSL.EMA_ALPHA", "0.5"]
    return opts + extra


def seed_as_train_net(cfg):
    """What train_net.py's default_setup does: the random init is a function of SEED (and
    rank), not of whatever RNG state the tests before left in this process."""
    from detectron2.utils import comm
    from detectron2.utils.env import seed_all_rng

    seed_all_rng(None if cfg.SEED < 0 else cfg.SEED + comm.get_rank())


def build_trainer(stage, opts, resume=False):
    """In-process trainer after build_cfg -> resolve_cfg -> resume_or_load."""
    from braixdet.config import build_cfg, resolve_cfg
    from braixdet.engine import trainer_class

    cfg = build_cfg(CONFIGS[stage], opts)
    cfg = resolve_cfg(cfg)
    cfg.freeze()
    seed_as_train_net(cfg)
    trainer = trainer_class(cfg)(cfg)
    trainer.resume_or_load(resume=resume)
    return trainer


def _env():
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def train_net_cmd(stage, opts, *args):
    return [sys.executable, TRAIN_NET, "--config-file", CONFIGS[stage], *args, *map(str, opts)]


def run_train_net(stage, opts, *args, timeout=240):
    """Run tools/train_net.py to completion; raises with the output tail when it fails."""
    return run_checked(train_net_cmd(stage, opts, *args), timeout=timeout)


def popen_train_net(stage, opts, *args, log_path=None):
    """Start tools/train_net.py in the background (stdout+stderr to ``log_path``)."""
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    try:
        return subprocess.Popen(train_net_cmd(stage, opts, *args), cwd=REPO, env=_env(),
                                stdout=log, stderr=subprocess.STDOUT)
    finally:
        if log_path:
            log.close()  # the child keeps its own descriptor


def run_checked(cmd, timeout=240):
    p = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=timeout)
    out = p.stdout.decode(errors="replace")
    if p.returncode != 0:
        raise AssertionError(f"{cmd[1]} exited {p.returncode}:\n{out[-6000:]}")
    return out


def run_gradcam(root, out, cache_dir, weights, json_out):
    """tools/gradcam_pseudo_labels.py on a stage-1 checkpoint (tiny config) -> parsed JSON."""
    opts = tiny_opts(root, out, cache_dir, stage="mvccl")
    run_checked([sys.executable, GRADCAM, "--config-file", CONFIGS["mvccl"], "--weights",
                 str(weights), "--out", str(json_out), "--batch-size", "2", *opts])
    with open(json_out) as f:
        return json.load(f)


def load_ckpt(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_state_equal(a, b, what=""):
    """Every tensor of two state dicts identical (torch.equal), same keys."""
    assert a.keys() == b.keys(), f"{what}: keys differ: {set(a) ^ set(b)}"
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"{what}: {len(diff)} tensors differ, e.g. {diff[:5]}"


def classification_metrics(out_dir, dataset):
    """classification_metrics.json written by the ClassificationEvaluator for ``dataset``."""
    hits = []
    for dirpath, _, files in os.walk(out_dir):
        if "classification_metrics.json" in files and os.path.basename(dirpath) == dataset:
            hits.append(os.path.join(dirpath, "classification_metrics.json"))
    assert len(hits) == 1, f"expected one classification_metrics.json for {dataset}: {hits}"
    with open(hits[0]) as f:
        return json.load(f)


def weak_cam_json(path, dataset_name):
    """Hand-written GradCAM JSON: one box (original px, the image's central quarter) for every
    malignant weak image, so the CAM-fusion branch of Algorithm 2 really fires."""
    from detectron2.data import DatasetCatalog

    images = {}
    for d in DatasetCatalog.get(dataset_name):
        if int(d["label"]) != 1:
            continue
        h, w = d["height"], d["width"]
        images[str(d["image_id"])] = {"boxes": [[w * 0.25, h * 0.25, w * 0.75, h * 0.75]],
                                      "scores": [0.9]}
    assert images, f"{dataset_name} has no malignant weak image"
    with open(path, "w") as f:
        json.dump({"meta": {"hand_written": True}, "images": images}, f)
    return path


def tree_digest(root):
    """sha256 of every file under root plus the sorted list of relative paths (and dirs)."""
    import hashlib

    entries = []
    for dirpath, dirnames, files in os.walk(root):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        entries.append(("d", rel, ""))
        for name in sorted(files):
            p = os.path.join(dirpath, name)
            with open(p, "rb") as f:
                entries.append(("f", os.path.join(rel, name), hashlib.sha256(f.read()).hexdigest()))
    return entries


class PickledCode:
    """An object whose unpickling runs code (creates ``marker``): what a crafted checkpoint
    holds; our loaders must refuse it without running it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))
