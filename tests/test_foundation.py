"""Foundation: detectron2 works on this CPU build, and our backport patch applies to the sdist."""
import hashlib
import importlib.util
import os
import subprocess

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def install_detectron2(load_tool):
    return load_tool("install_detectron2")


def test_detectron2_generalized_rcnn_trains_one_step_on_cpu():
    from detectron2.config import get_cfg
    from detectron2.modeling import build_model
    from detectron2.structures import Boxes, Instances
    from detectron2.utils.events import EventStorage

    cfg = get_cfg()
    cfg.MODEL.DEVICE = "cpu"
    cfg.MODEL.META_ARCHITECTURE = "GeneralizedRCNN"
    cfg.MODEL.BACKBONE.NAME = "build_resnet_fpn_backbone"
    cfg.MODEL.RESNETS.DEPTH = 18
    cfg.MODEL.RESNETS.RES2_OUT_CHANNELS = 64
    cfg.MODEL.RESNETS.OUT_FEATURES = ["res2", "res3", "res4", "res5"]
    cfg.MODEL.FPN.IN_FEATURES = ["res2", "res3", "res4", "res5"]
    cfg.MODEL.FPN.OUT_CHANNELS = 32
    cfg.MODEL.RPN.IN_FEATURES = ["p2", "p3", "p4", "p5", "p6"]
    cfg.MODEL.ROI_HEADS.NAME = "StandardROIHeads"
    cfg.MODEL.ROI_HEADS.IN_FEATURES = ["p2", "p3", "p4", "p5"]
    cfg.MODEL.ROI_HEADS.NUM_CLASSES = 1
    cfg.MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE = 32
    cfg.MODEL.ROI_BOX_HEAD.NAME = "FastRCNNConvFCHead"
    cfg.MODEL.ROI_BOX_HEAD.NUM_FC = 1
    cfg.MODEL.ROI_BOX_HEAD.FC_DIM = 64
    cfg.MODEL.RPN.POST_NMS_TOPK_TRAIN = 100
    torch.manual_seed(0)
    model = build_model(cfg)
    model.train()
    inst = Instances((96, 128))
    inst.gt_boxes = Boxes(torch.tensor([[20.0, 20.0, 60.0, 70.0]]))
    inst.gt_classes = torch.zeros(1, dtype=torch.int64)
    batch = [{"image": torch.rand(3, 96, 128) * 255, "instances": inst}]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with EventStorage(0):
        losses = model(batch)
        assert set(losses) == {"loss_cls", "loss_box_reg", "loss_rpn_cls", "loss_rpn_loc"}
        total = sum(losses.values())
        assert torch.isfinite(total)
        opt.zero_grad()
        total.backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_backport_patch_applies_to_the_pinned_sdist(tmp_path, install_detectron2):
    """Downloads (or reuses the cached) pb1-detectron2 0.6 sdist, checks its sha256, applies."""
    if not _patch_tool_available():
        pytest.skip("the 'patch' program is not installed")
    try:
        sdist = install_detectron2.download_sdist(str(tmp_path))
    except OSError as e:  # no network and no cached copy
        pytest.skip(f"sdist not available offline: {e}")
    with open(sdist, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == install_detectron2.SDIST_SHA256
    root = install_detectron2.unpack_and_patch(sdist, str(tmp_path))
    # every patched file carries the backport, and nothing is left half-applied
    assert not list(tmp_path.rglob("*.rej"))
    launch = open(os.path.join(root, "detectron2/engine/launch.py")).read()
    assert '"NCCL" if has_gpu else "GLOO"' in launch
    for rel in ["detectron2/layers/deform_conv.py", "detectron2/layers/roi_align_rotated.py",
                "detectron2/layers/rotated_boxes.py", "detectron2/evaluation/fast_eval_api.py"]:
        assert "except ImportError" in open(os.path.join(root, rel)).read(), rel
    assert "interp=Image.LINEAR" not in open(os.path.join(root, "detectron2/data/transforms/"
                                                               "transform.py")).read()
    assert "import pkg_resources" not in open(os.path.join(root, "detectron2/model_zoo/"
                                                          "model_zoo.py")).read()


def test_installed_detectron2_is_ours_or_the_users(install_detectron2):
    """The installer keeps an importable detectron2 and recognises its own patched build."""
    assert importlib.util.find_spec("detectron2") is not None
    assert install_detectron2.installed_state() in ("current", "user")


def test_model_zoo_works_without_pkg_resources():
    """The sdist ships no model-zoo configs; the module must still import and answer."""
    from detectron2 import model_zoo

    url = model_zoo.get_checkpoint_url("COCO-Detection/faster_rcnn_R_50_FPN_1x.yaml")
    assert url.endswith("model_final_b275ba.pkl")
    with pytest.raises(RuntimeError, match="not available in Model Zoo"):
        model_zoo.get_config_file("COCO-Detection/faster_rcnn_R_50_FPN_1x.yaml")


def _patch_tool_available():
    return subprocess.run(["sh", "-c", "command -v patch"], capture_output=True).returncode == 0
