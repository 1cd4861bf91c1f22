"""File names built from values read out of input files never leave the output folder."""
import os
import sys

import pydicom
import pytest

from braixdet.utils import safe_file_name, safe_output_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = ["INPUT.BRAIXDET.CANONICAL_SIZE", "(128, 64)", "INPUT.BRAIXDET.MASK_DOWNSAMPLE", "2"]


@pytest.mark.parametrize("value", ["/tmp/x", "../../../tmp/x", "..", ".", "a/b\\c", "a\x00b",
                                   "", "x" * 5000, "~root", "C:\\evil", "ü-ß"])
def test_safe_file_name_is_one_bounded_component(value, tmp_path):
    name = safe_file_name(value, ".png")
    assert os.sep not in name and "\\" not in name and "\x00" not in name
    assert not name.startswith(".") and len(name) <= 200
    assert os.path.dirname(safe_output_path(tmp_path, value, ".png")) == str(tmp_path)


def test_distinct_values_never_share_a_file():
    values = ["a/b", "a_b", "a\\b", "a b", "x" * 300, "x" * 301]
    assert len({safe_file_name(v) for v in values}) == len(values)
    assert safe_file_name("1.2.840.5") == "1.2.840.5"  # a well-formed UID stays readable


def test_planted_symlink_in_output_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(tmp_path / "elsewhere.png", out / "img.png")
    with pytest.raises(ValueError, match="outside the output folder"):
        safe_output_path(out, "img", ".png")


def test_predict_with_hostile_uids_writes_only_inside_out(synthetic_root, tmp_path):
    """tools/predict.py on DICOMs whose SOPInstanceUIDs are absolute paths, '..' chains,
    separators and very long strings: every file it writes is inside --out."""
    from detectron2.modeling import build_model

    from braixdet.engine.checkpoint import export_model_only
    from braixdet.engine.setup import build_cfg

    sys.path.insert(0, os.path.join(REPO, "tools"))
    import predict

    victim = tmp_path / "victim"
    hostile = [str(victim / "abs"), "../../victim/dotdot", "a/b/../../../victim/sep",
               "..", "y" * 3000]
    src = [r for r in synthetic_root.summary["truth"] if r["split"] == "test"][: len(hostile)]
    inp = tmp_path / "in"
    inp.mkdir()
    for i, (rec, uid) in enumerate(zip(src, hostile)):
        ds = pydicom.dcmread(os.path.join(synthetic_root.root, rec["path"]))
        ds.SOPInstanceUID = uid
        ds.file_meta.MediaStorageSOPInstanceUID = "1.2.3"
        ds.save_as(inp / f"{i}.dcm", enforce_file_format=True)

    cfg_file = os.path.join(REPO, "configs", "demo", "BRAIxDet", "braixdet.yaml")
    cfg = build_cfg(cfg_file, ["MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", "",
                               "MODEL.BRAIXDET.PRETRAINED", "", *SIZE])
    weights = str(tmp_path / "w.pth")
    export_model_only(build_model(cfg), weights)
    out = tmp_path / "out"
    before = {p for p in tmp_path.rglob("*")} - {p for p in out.rglob("*")}
    predict.main(["--config-file", cfg_file, "--weights", weights, "--input", str(inp),
                  "--out", str(out), "--overlay-thresh", "0.0",
                  "MODEL.BRAIXDET.PRETRAINED", "", *SIZE])
    written = {p for p in tmp_path.rglob("*")} - before
    outside = [p for p in written if out not in p.parents and p != out]
    assert not outside, outside
    assert not victim.exists()
    pngs = list(out.glob("*.png"))
    assert len(pngs) == len(hostile)  # one overlay per image, none lost to a name clash
