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
    with pytest.raises(ValueError, match="it is a symbolic link"):
        safe_output_path(out, "img", ".png")
    os.unlink(out / "img.png")
    os.symlink(out / "other.png", out / "img.png")  # a link inside the folder: refused too
    with pytest.raises(ValueError, match="it is a symbolic link"):
        safe_output_path(out, "img", ".png")


def test_predict_with_hostile_uids_writes_only_inside_out(synthetic_root, tmp_path, load_tool):
    """tools/predict.py on DICOMs whose SOPInstanceUIDs are absolute paths, '..' chains,
    separators and very long strings: every file it writes is inside --out, and each such
    image is refused at read time (not a UID per PS3.5 §9: ``invalid_value``, one line each;
    ``safe_output_path`` above still bounds any name)."""
    import json

    from detectron2.modeling import build_model

    from braixdet.config import build_cfg
    from braixdet.utils.checkpoint import export_model_only

    predict = load_tool("predict")

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
    report = json.loads((out / "report.json").read_text())
    assert len(report["errors"]) == len(hostile) and {
        (e["reason"], e["detail"]) for e in report["errors"]} == {
        ("invalid_value", "SOPInstanceUID (UI) is not valid per PS3.5 §9"),
        ("invalid_value", "SOPInstanceUID (UI) is longer than its VR allows")}


def _tiny_predictor(tmp_path):
    from detectron2.modeling import build_model

    from braixdet.config import build_cfg
    from braixdet.utils.checkpoint import export_model_only

    cfg_file = os.path.join(REPO, "configs", "demo", "BRAIxDet", "braixdet.yaml")
    cfg = build_cfg(cfg_file, ["MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", "",
                               "MODEL.BRAIXDET.PRETRAINED", "", *SIZE])
    weights = str(tmp_path / "w.pth")
    export_model_only(build_model(cfg), weights)
    return cfg_file, weights


def _one_exam(synthetic_root, tmp_path):
    """Input folder with the 4 images of one test exam; returns (folder, their UIDs)."""
    import shutil

    inp = tmp_path / "in"
    inp.mkdir()
    rows = [r for r in synthetic_root.summary["truth"] if r["split"] == "test"][:4]
    uids = []
    for i, rec in enumerate(rows):
        src = os.path.join(synthetic_root.root, rec["path"])
        shutil.copy(src, inp / f"{i}.dcm")
        uids.append(str(pydicom.dcmread(src, stop_before_pixels=True).SOPInstanceUID))
    return inp, uids


def test_predict_planted_symlinks_never_followed_run_completes(synthetic_root, tmp_path, load_tool):
    """Issue 21 item 1: a symlinked <uid>.png is one bad-input line (the other overlays and
    predictions.json are written); a symlinked predictions.json / report.json is replaced by
    the real file; no link target is ever written."""
    import json

    predict = load_tool("predict")

    inp, uids = _one_exam(synthetic_root, tmp_path)
    cfg_file, weights = _tiny_predictor(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    victims = {name: tmp_path / f"victim_{name}" for name in
               (f"{uids[0]}.png", "predictions.json", "report.json")}
    for name, victim in victims.items():
        victim.write_text("keep")
        os.symlink(victim, out / name)
    os.symlink(tmp_path / "dangling.png", out / f"{uids[1]}.png")
    predict.main(["--config-file", cfg_file, "--weights", weights, "--input", str(inp),
                  "--out", str(out), "--overlay-thresh", "0.0",
                  "MODEL.BRAIXDET.PRETRAINED", "", *SIZE])
    assert all(v.read_text() == "keep" for v in victims.values())
    assert not (tmp_path / "dangling.png").exists()
    preds = json.loads((out / "predictions.json").read_text())
    assert not (out / "predictions.json").is_symlink()
    assert len(preds["images"]) == len(uids) and preds["report"] == {"refused_output": 2}
    report = json.loads((out / "report.json").read_text())
    refused = sorted(os.path.basename(e["path"]) for e in report["errors"])
    assert refused == sorted(f"{u}.png" for u in uids[:2]), report
    assert all(not (out / f"{u}.png").is_symlink() and (out / f"{u}.png").stat().st_size > 100
               for u in uids[2:])


def test_predict_refusals_are_one_line_without_traceback(synthetic_root, tmp_path):
    """Issue 21 item 9: a second predict.py on a busy --out and a crafted pickle checkpoint
    each end with exit 1 and one ``error:`` line, no traceback."""
    import subprocess

    import torch
    from _train_helpers import PickledCode

    from braixdet.utils.output_lock import acquire_output_lock

    inp, _ = _one_exam(synthetic_root, tmp_path)
    cfg_file = os.path.join(REPO, "configs", "demo", "BRAIxDet", "braixdet.yaml")
    crafted = tmp_path / "crafted.pth"
    torch.save({"model": {}, "x": PickledCode(str(tmp_path / "pwned"))}, crafted)
    busy = tmp_path / "busy"

    def run(out, weights):
        cmd = [sys.executable, os.path.join(REPO, "tools", "predict.py"), "--config-file",
               cfg_file, "--weights", str(weights), "--input", str(inp), "--out", str(out),
               "MODEL.BRAIXDET.PRETRAINED", "", *SIZE]
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        return p.returncode, (p.stdout + p.stderr).strip()

    lock = acquire_output_lock(busy, tool="test")
    try:
        rc, text = run(busy, crafted)
    finally:
        lock.release()
    assert rc == 1 and "Traceback" not in text, text[-2000:]
    assert text.splitlines()[-1].startswith(f"error: OUTPUT_DIR {busy} is in use by another "
                                            f"run (pid {os.getpid()}"), text[-2000:]
    rc, text = run(tmp_path / "free", crafted)
    assert rc == 1 and "Traceback" not in text, text[-2000:]
    assert text.splitlines()[-1] == (
        f"error: refusing to load {crafted}: it contains Python objects other than tensors and "
        "plain values (weights_only)"), text[-2000:]
    assert not (tmp_path / "pwned").exists()


def test_writer_helpers_never_follow_links(tmp_path):
    """The helpers every writer uses (the pipeline's results and stage logs included):
    ``atomic_write_json`` replaces a planted link by the file, ``open_no_follow`` refuses to
    write or append through one, ``refuse_links`` names the first link of a folder."""
    from braixdet.utils.io import (
        OutputPathRefused,
        atomic_write_json,
        open_no_follow,
        refuse_links,
    )

    victim = tmp_path / "victim"
    victim.write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim, out / "results.json")
    atomic_write_json(out / "results.json", {"ok": 1})
    assert victim.read_text() == "keep" and not (out / "results.json").is_symlink()
    assert (out / "results.json").read_text() == '{"ok": 1}'
    for mode in ("w", "a", "ab"):
        os.symlink(victim, out / f"stage_{mode}.log")
        with pytest.raises(OutputPathRefused, match="it is a symbolic link"):
            open_no_follow(out / f"stage_{mode}.log", mode)
    assert victim.read_text() == "keep"
    with open_no_follow(out / "stage_w.log", "w", replace_link=True) as f:  # the stage logs
        f.write("log")
    assert victim.read_text() == "keep" and (out / "stage_w.log").read_text() == "log"
    with pytest.raises(OutputPathRefused) as e:
        refuse_links(out)
    assert e.value.path == str(out / "stage_a.log")
    deep = tmp_path / "deep"
    (deep / "inference" / "cbis_test").mkdir(parents=True)
    refuse_links(deep)  # no link: nothing to refuse
    os.symlink(victim, deep / "inference" / "cbis_test" / "metrics.json")
    with pytest.raises(OutputPathRefused, match="cbis_test/metrics.json"):
        refuse_links(deep)
    with open_no_follow(out / "real.log", "a") as f:
        f.write("x")
    with open_no_follow(out / "real.log", "a") as f:
        f.write("y")
    assert (out / "real.log").read_text() == "xy"


def test_tool_error_line_is_printed_once_without_traceback(capsys, synthetic_root, tmp_path):
    """What the pipeline needs to show a stage's own line (issue 21 item 5): train_net's
    output ends with ``error: KEY = value: allowed: ...``; last_error_line finds it and
    run_tool prints it (ToolError) without a traceback."""
    import subprocess

    from _train_helpers import CONFIGS, tiny_opts

    from braixdet.cli import ToolError, last_error_line, run_tool

    opts = tiny_opts(synthetic_root.root, tmp_path / "o", tmp_path / "c", stage="mvccl",
                     extra=["DATASETS.BRAIXDET.RATIO", "1/0"])
    p = subprocess.run([sys.executable, os.path.join(REPO, "tools", "train_net.py"),
                        "--config-file", CONFIGS["mvccl"], *opts], cwd=REPO, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    line = last_error_line(p.stdout.splitlines())
    assert p.returncode == 1 and line == ("error: DATASETS.BRAIXDET.RATIO = '1/0': allowed: a "
                                          "fraction in (0, 1] such as '1/8' or 0.125"), p.stdout
    assert last_error_line(["error: x", "Traceback ..."]) is None

    def stage_failed(argv):
        raise ToolError(line)

    assert run_tool(stage_failed) == 1
    assert capsys.readouterr().err == line + "\n"


def test_every_tool_ends_through_run_tool(tmp_path):
    """The README's promise of one actionable last line on failure holds for every tool (issue
    30): each tools/*.py but install_detectron2 (it installs what the package imports) exits
    through ``sys.exit(run_tool(main))``; tools/visualize.py, which let its exception escape
    before, ends with the one line naming the file, exit status 1, and no traceback."""
    import ast
    import subprocess

    outside = []
    for name in sorted(os.listdir(os.path.join(REPO, "tools"))):
        if not name.endswith(".py") or name == "install_detectron2.py":
            continue
        with open(os.path.join(REPO, "tools", name)) as f:
            tree = ast.parse(f.read())
        mains = [n for n in tree.body
                 if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        if not mains or "sys.exit(run_tool(" not in ast.unparse(mains[-1]):
            outside.append(name)
    assert not outside, f"tools not ending with sys.exit(run_tool(main)): {outside}"
    missing = tmp_path / "missing.dcm"
    p = subprocess.run([sys.executable, os.path.join(REPO, "tools", "visualize.py"), "--dicom",
                        str(missing), "--out", str(tmp_path / "vis")], cwd=REPO, text=True,
                       capture_output=True, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1] == f"error: {missing}: missing_file (no such file)"
