"""Hostile and broken inputs (issue #15): corrupted cache entries, crafted CSV cells, a second
run on a busy OUTPUT_DIR, checks before training, a full disk and refused checkpoints."""
import json
import logging
import os

import numpy as np
import pytest

from braixdet.data.preprocess import PreprocessParams
from braixdet.data.report import BadInputError

PARAMS = PreprocessParams(canonical_size=(128, 64), margin=0.02, downsample=4)


# ------------------------------------------------------------------------------ cache entries
def _dicom(path):
    from braixdet.data.dicom import write_dicom

    h, w = 300, 240
    yy, xx = np.mgrid[0:h, 0:w]
    r = np.hypot((yy - h * 0.55) / (0.38 * h), xx / (0.55 * w))
    img = np.where(r < 1, 0.45 + 0.35 * (1 - r), 0.03)
    img = img + np.random.default_rng(0).normal(0, 0.01, (h, w))
    pixels = (np.clip(img, 0, 1) * 4000).astype(np.uint16)
    return write_dicom(path, pixels, bits_stored=12, ImageLaterality="L")


def _flip_data_bytes(path):
    data = bytearray(open(path, "rb").read())
    for i in range(len(data) - 400, len(data) - 200):  # pixel data, the header stays intact
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _drop_checksum(path):
    record = json.load(open(path))
    del record["image"]
    json.dump(record, open(path, "w"))


def _wrong_shape(path):
    np.save(path, np.zeros((64, 32), np.uint16), allow_pickle=False)


_CORRUPTIONS = {
    "npy_zero_bytes": (".npy", lambda p: open(p, "wb").close()),
    "npy_truncated": (".npy", lambda p: os.truncate(p, os.path.getsize(p) // 2)),
    "npy_data_flipped_header_intact": (".npy", _flip_data_bytes),
    "npy_wrong_shape": (".npy", _wrong_shape),
    "npy_missing": (".npy", os.remove),
    "sidecar_empty_object": (".json", lambda p: open(p, "w").write("{}")),
    "sidecar_empty_list": (".json", lambda p: open(p, "w").write("[]")),
    "sidecar_not_json": (".json", lambda p: open(p, "w").write("not json {")),
    "sidecar_deeply_nested": (".json", lambda p: open(p, "w").write("[" * 100_000)),
    "sidecar_without_checksum": (".json", _drop_checksum),
    "png_data_flipped": (".png", _flip_data_bytes),
    "png_zero_bytes": (".png", lambda p: open(p, "wb").close()),
}


@pytest.mark.parametrize("kind", sorted(_CORRUPTIONS))
def test_invalid_cache_entry_is_rebuilt_never_used(tmp_path, caplog, kind):
    from braixdet.data.cache import CanonicalCache

    ext, corrupt = _CORRUPTIONS[kind]
    fmt = "png" if ext == ".png" else "npy"
    dcm = _dicom(tmp_path / "a.dcm")
    cache = CanonicalCache(tmp_path / "cache", PARAMS, fmt=fmt)
    fresh, tfm = cache.get(dcm, "L")  # cold: a fresh decode
    stem = cache.entry_path(dcm, "L")
    corrupt(stem + ext)

    reader = CanonicalCache(tmp_path / "cache", PARAMS, fmt=fmt)  # e.g. the next run
    with caplog.at_level(logging.WARNING, logger="braixdet.data.cache"):
        img, tfm2 = reader.get(dcm, "L")
    assert np.array_equal(img, fresh)
    assert tfm2.transforms and len(tfm2.transforms) == len(tfm.transforms)
    assert reader.rebuilt == 1 and sum(reader.rebuilt_reasons.values()) == 1
    lines = [r.getMessage() for r in caplog.records if "rebuilt" in r.getMessage()]
    assert len(lines) == 1 and stem in lines[0] and "\n" not in lines[0], lines
    # the rebuilt entry is valid again: a plain hit
    img3, _ = reader.get(dcm, "L")
    assert np.array_equal(img3, fresh) and reader.rebuilt == 1


def test_valid_cache_entry_is_not_rebuilt(tmp_path):
    from braixdet.data.cache import CanonicalCache

    dcm = _dicom(tmp_path / "a.dcm")
    cache = CanonicalCache(tmp_path / "cache", PARAMS)
    first, _ = cache.get(dcm, "L")
    stem = cache.entry_path(dcm, "L")
    mtime = os.path.getmtime(stem + ".npy")
    again, _ = CanonicalCache(tmp_path / "cache", PARAMS).get(dcm, "L")
    assert np.array_equal(first, again) and os.path.getmtime(stem + ".npy") == mtime
    assert cache.rebuilt == 0


@pytest.mark.parametrize("fmt", ["npy", "png"])
def test_foreign_cache_entry_copied_over_is_rebuilt(tmp_path, caplog, fmt):
    """Issue 21 item 7: another image's complete, self-consistent entry (image + sidecar)
    copied over this image's entry was used. Now the sidecar's source (path, size, mtime,
    side) must match the DICOM read: the entry is rebuilt."""
    import shutil

    from braixdet.data.cache import CanonicalCache
    from braixdet.data.dicom import write_dicom

    a = _dicom(tmp_path / "a.dcm")
    b = write_dicom(tmp_path / "b.dcm", np.full((300, 240), 4000, np.uint16), bits_stored=12,
                    ImageLaterality="L")
    cache = CanonicalCache(tmp_path / "cache", PARAMS, fmt=fmt)
    img_a, _ = cache.get(a, "L")
    img_b, _ = cache.get(b, "L")
    assert not np.array_equal(img_a, img_b)
    stem_a, stem_b = cache.entry_path(a, "L"), cache.entry_path(b, "L")
    for ext in ("." + fmt, ".json"):
        shutil.copyfile(stem_b + ext, stem_a + ext)
    reader = CanonicalCache(tmp_path / "cache", PARAMS, fmt=fmt)
    with caplog.at_level(logging.WARNING, logger="braixdet.data.cache"):
        got, _ = reader.get(a, "L")
    assert np.array_equal(got, img_a) and reader.rebuilt == 1
    assert dict(reader.rebuilt_reasons) == {"foreign entry": 1}
    assert np.array_equal(reader.get(a, "L")[0], img_a) and reader.rebuilt == 1  # valid again


# ------------------------------------------------------------------------------ hostile CSV cells
_HOSTILE_BOXES = {
    "400_digit_number": json.dumps([[1, 2, 3, 4]]).replace("3", "9" * 400),
    "nesting_depth_10000": "[" * 10_000 + "]" * 10_000,
    "json_true": "[[true, 2, 30, 40]]",
    "json_NaN": "[[NaN, 2, 30, 40]]",
    "json_Infinity": "[[1, 2, Infinity, 40]]",
    "1e999": "[[1, 2, 1e999, 40]]",
    "huge_magnitude": "[[1, 2, 3e7, 40]]",
    "10_MB_cell": "[" + ",".join(["[1, 2, 30, 40]"] * 700_000) + "]",
    "100_kB_cell": "[" + ",".join(["[1, 2, 30, 40]"] * 7_000) + "]",
    "wrong_arity": "[[1, 2, 30]]",
    "strings_not_numbers": '[["1", "2", "30", "40"]]',
    "object_not_list": '{"x0": 1}',
}


def _exam_rows(synthetic_root):
    root = synthetic_root.root
    with open(os.path.join(root, "exams.csv"), newline="") as f:
        header, *rows = list(__import__("csv").reader(f))
    for r in rows:
        r[2] = os.path.join(root, r[2])  # absolute paths inside the root: the CSV can be elsewhere
    return header, rows


def _write(path, header, rows):
    import csv

    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([header] + rows)
    return str(path)


def _assert_reported(report, csv_path, line, n_bad=1):
    assert report.num_bad == n_bad, report.to_dict()["errors"]
    e = report.errors[0]
    assert e["reason"] == "bad_row", e
    assert e["path"] == csv_path or os.path.basename(csv_path) in e["detail"], e
    assert f"line {line}" in e["detail"] and "\n" not in e["detail"], e


@pytest.mark.parametrize("case", sorted(_HOSTILE_BOXES))
def test_exam_csv_hostile_boxes_cell_reported_with_line(synthetic_root, tmp_path, case):
    from braixdet.data.datasets import load_exam_csv
    from braixdet.data.report import BadInputError, BadInputReport

    header, rows = _exam_rows(synthetic_root)
    victim = next(i for i, r in enumerate(rows) if r[5] == "1" and r[6] == "full")
    bad = list(rows.pop(victim))
    bad[7] = _HOSTILE_BOXES[case]
    rows.insert(3, bad)
    csv_path = _write(tmp_path / "exams.csv", header, rows)
    report = BadInputReport("hostile")
    dicts = load_exam_csv(csv_path, synthetic_root.root, report)
    _assert_reported(report, csv_path, line=5)  # header = line 1, rows[3] = line 5
    assert len(dicts) == len(rows) - 1  # every other row still loaded
    assert bad[2] not in {d["file_name"] for d in dicts}
    with pytest.raises(BadInputError) as e:  # ON_BAD_INPUT error: one line, no other type
        load_exam_csv(csv_path, synthetic_root.root, BadInputReport("x", on_bad_input="error"))
    assert "line 5" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("case", ["nul_in_path", "100_kB_patient_id"])
def test_exam_csv_hostile_other_cells(synthetic_root, tmp_path, case):
    from braixdet.data.datasets import load_exam_csv
    from braixdet.data.report import BadInputReport

    header, rows = _exam_rows(synthetic_root)
    bad = list(rows.pop(0))
    if case == "nul_in_path":
        bad[2] = bad[2].replace("1-1.dcm", "1-1\0.dcm")
    else:
        bad[0] = "p" * 100_000
    rows.append(bad)
    csv_path = _write(tmp_path / "exams.csv", header, rows)
    report = BadInputReport("hostile")
    dicts = load_exam_csv(csv_path, synthetic_root.root, report)
    _assert_reported(report, csv_path, line=len(rows) + 1)
    assert len(dicts) == len(rows) - 1


def _vindr_tree(synthetic_root, tmp_path):
    """A VinDr-Mammo layout of one synthetic patient with a malignant lesion (copies)."""
    import shutil

    truth = synthetic_root.summary["truth"]
    patient = next(t["patient"] for t in truth
                   if any(les["malignant"] for les in t["lesions"]))
    vroot = tmp_path / "vindr"
    breast, finding = [], []
    for i, t in enumerate(t for t in truth if t["patient"] == patient):
        image = f"img{i:03d}"
        (vroot / "images" / "study0").mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(synthetic_root.root, t["path"]),
                    vroot / "images" / "study0" / f"{image}.dicom")
        common = ["study0", "series", image, t["laterality"], t["view"], t["rows"], t["cols"]]
        breast.append(common + ["BI-RADS 2", "DENSITY C", "training"])
        for les in t["lesions"]:
            birads = "BI-RADS 5" if les["malignant"] else "BI-RADS 3"
            finding.append(common + ["BI-RADS 4", "DENSITY C", "['Mass']", birads, *les["bbox"],
                                     "training"])
    head = ["study_id", "series_id", "image_id", "laterality", "view_position", "height", "width"]
    bhead = head + ["breast_birads", "breast_density", "split"]
    fhead = head + ["breast_birads", "breast_density", "finding_categories", "finding_birads",
                    "xmin", "ymin", "xmax", "ymax", "split"]
    return vroot, bhead, breast, fhead, finding


_HOSTILE_NUMBERS = {
    "400_digit_number": "9" * 400,
    "json_true": "true",
    "NaN": "NaN",
    "Infinity": "Infinity",
    "1e999": "1e999",
    "underscored": "1_000",
    "fullwidth_digits": "\uff11\uff12",
}


@pytest.mark.parametrize("case", sorted(_HOSTILE_NUMBERS))
def test_vindr_hostile_box_cell_reported_with_line(synthetic_root, tmp_path, case):
    from braixdet.data.datasets import load_vindr_mammo
    from braixdet.data.report import BadInputReport

    vroot, bhead, breast, fhead, finding = _vindr_tree(synthetic_root, tmp_path)
    i = next(i for i, r in enumerate(finding) if r[10] == "BI-RADS 5")
    finding[i][13] = _HOSTILE_NUMBERS[case]  # xmax of a malignant finding
    _write(vroot / "breast-level_annotations.csv", bhead, breast)
    fcsv = _write(vroot / "finding_annotations.csv", fhead, finding)
    report = BadInputReport("hostile")
    dicts = load_vindr_mammo(str(vroot), report)
    _assert_reported(report, fcsv, line=i + 2)
    assert len(dicts) == len(breast)  # the image is kept, without the box: made weak
    d = next(d for d in dicts if d["image_id"] == finding[i][2])
    assert d["annotation_type"] == "weak" and d["label"] == 1


@pytest.mark.parametrize("case", ["1e999", "400_digit_number", "NaN", "10_MB_cell"])
def test_vindr_hostile_size_cell_reported_with_line(synthetic_root, tmp_path, case):
    from braixdet.data.datasets import load_vindr_mammo
    from braixdet.data.report import BadInputReport

    vroot, bhead, breast, fhead, finding = _vindr_tree(synthetic_root, tmp_path)
    breast[1][5] = "9" * 10_000_000 if case == "10_MB_cell" else _HOSTILE_NUMBERS[case]
    bcsv = _write(vroot / "breast-level_annotations.csv", bhead, breast)
    _write(vroot / "finding_annotations.csv", fhead, finding)
    report = BadInputReport("hostile")
    dicts = load_vindr_mammo(str(vroot), report)  # 1e999 was an OverflowError
    _assert_reported(report, bcsv, line=3)
    assert len(dicts) == len(breast) - 1


@pytest.mark.parametrize("case", ["nul_in_path", "100_kB_pathology"])
def test_cbis_hostile_cells_reported_with_line(synthetic_root, tmp_path, case):
    import csv
    import shutil

    from braixdet.data.datasets import load_cbis_ddsm
    from braixdet.data.report import BadInputReport

    root = tmp_path / "cbis"
    shutil.copytree(synthetic_root.root, root)
    good = load_cbis_ddsm(str(root), BadInputReport())
    name = next(n for n in sorted(os.listdir(root)) if n.endswith("_set.csv"))
    path = str(root / name)
    with open(path, newline="") as f:
        header, *rows = list(csv.reader(f))
    col = header.index("image file path") if case == "nul_in_path" else header.index("pathology")
    rows[0][col] = rows[0][col] + "\0x" if case == "nul_in_path" else "M" * 100_000
    _write(path, header, rows)
    report = BadInputReport("hostile")
    dicts = load_cbis_ddsm(str(root), report)  # the NUL byte was a ValueError
    assert report.num_bad >= 1
    e = report.errors[0]
    assert e["reason"] == "bad_row", e
    assert f"{name}:2" in e["detail"] or (e["path"] == path and "line 2" in e["detail"]), e
    assert len(dicts) >= len(good) - 1


# ------------------------------------------------------------------------------ train_net helpers
def _tiny(synthetic_root, tmp_path, out, stage="mvccl", **kw):
    from _train_helpers import tiny_opts

    return tiny_opts(synthetic_root.root, out, tmp_path / "cache", stage=stage, **kw)


def _cli(stage, opts, *args):
    """tools/train_net.py (the package's train_net.cli) in this process: (exit status, last
    line of stderr)."""
    import contextlib
    import io

    from _train_helpers import CONFIGS

    from braixdet.pipeline.train_net import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli(["--config-file", CONFIGS[stage], *args, *map(str, opts)])
    lines = err.getvalue().strip().splitlines()
    return rc, (lines[-1] if lines else ""), err.getvalue()


# ------------------------------------------------------------------------------ OUTPUT_DIR lock
def test_second_run_on_same_output_dir_is_refused(synthetic_root, tmp_path):
    """A running train_net holds OUTPUT_DIR: a second one exits 1 with one line and writes
    nothing; the first keeps running. After a SIGKILL its stale lock is taken over."""
    import re
    import signal
    import socket
    import subprocess
    import time

    from _train_helpers import REPO, popen_train_net, train_net_cmd

    from braixdet.utils.output_lock import acquire_output_lock

    out = tmp_path / "out"
    # no periodic checkpoint: on a loaded machine the first run reached iteration 100 and
    # wrote one while the second started, and the folder listing below is about the second
    opts = _tiny(synthetic_root, tmp_path, out, max_iter=100_000, ckpt_period=10**9,
                 extra=["DATASETS.TEST", "()"])
    first = popen_train_net("mvccl", opts, log_path=tmp_path / "first.log")
    try:
        deadline = time.monotonic() + 180
        while not re.search(r"Starting training from iteration",
                            (tmp_path / "first.log").read_text(errors="replace")):
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        lock_before = (out / ".lock").read_text()
        listing = sorted(os.listdir(out))
        log_before = (out / "log.txt").read_text()
        config_before = (out / "config.yaml").read_bytes()

        second = subprocess.run(train_net_cmd("mvccl", opts), cwd=REPO, timeout=240,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        text = second.stdout.decode(errors="replace").strip()
        assert second.returncode == 1, text[-3000:]
        last = text.splitlines()[-1]
        want = (rf"error: OUTPUT_DIR {re.escape(str(out))} is in use by another run \(pid "
                rf"{first.pid} on host {re.escape(socket.gethostname())}, started [0-9: -]+\); "
                r"use another OUTPUT_DIR or stop that run")
        assert re.fullmatch(want, last), last
        assert "Traceback" not in text and text.count("error:") == 1, text[-3000:]
        # the first run is unaffected: still running, nothing of the second in its folder
        assert first.poll() is None
        assert (out / ".lock").read_text() == lock_before
        assert sorted(os.listdir(out)) == listing
        assert (out / "config.yaml").read_bytes() == config_before
        assert (out / "log.txt").read_text().startswith(log_before)
        assert (out / "log.txt").read_text().count("Command line arguments") == 1

        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    # the dead run's lock file is still there, naming it; the next run takes it over
    assert json.loads((out / ".lock").read_text())["pid"] == first.pid
    acquire_output_lock(out).release()


def _assert_released(out):
    from braixdet.utils.output_lock import acquire_output_lock

    acquire_output_lock(out).release()  # free for the next run


def _dead_pid():
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_lock_of_dead_process_is_taken_over(tmp_path):
    import socket

    from braixdet.utils.output_lock import OutputDirInUseError, acquire_output_lock

    out = tmp_path / "out"
    out.mkdir()
    pid = _dead_pid()
    (out / ".lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(),
                                           "started": "2020-01-01 00:00:00"}))
    lock = acquire_output_lock(out, tool="test")  # the dead holder's flock is gone
    assert json.loads((out / ".lock").read_text())["pid"] == os.getpid()
    with pytest.raises(OutputDirInUseError, match=f"pid {os.getpid()} on host"):
        acquire_output_lock(out)  # a second run inside this process is a second run
    lock.release()
    acquire_output_lock(out).release()  # free again
    # a live holder (here: an open flock of another open file description) refuses
    import fcntl

    other = os.open(out / ".lock", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    os.write(other, json.dumps({"pid": 1, "host": "h", "started": "s"}).encode())
    fcntl.flock(other, fcntl.LOCK_EX)
    try:
        with pytest.raises(OutputDirInUseError) as e:
            acquire_output_lock(out)
        assert str(e.value) == (f"OUTPUT_DIR {out} is in use by another run (pid 1 on host h, "
                                "started s); use another OUTPUT_DIR or stop that run")
    finally:
        os.close(other)


def test_symlinked_lock_file_is_refused_and_never_written(tmp_path):
    """Issue 21 item 1: ``ln -s $PWD/v o/.lock`` made the lock write its JSON into ``v``."""
    from braixdet.utils.io import OutputPathRefused
    from braixdet.utils.output_lock import acquire_output_lock

    out, victim = tmp_path / "o", tmp_path / "v"
    out.mkdir()
    victim.write_text("keep")
    os.symlink(victim, out / ".lock")
    with pytest.raises(OutputPathRefused) as e:
        acquire_output_lock(out)
    assert str(e.value).startswith(f"refusing to write {out / '.lock'}: it is a symbolic link")
    assert victim.read_text() == "keep"
    os.unlink(out / ".lock")
    os.symlink(tmp_path / "dangling", out / ".lock")  # a dangling link is not created through
    with pytest.raises(OutputPathRefused):
        acquire_output_lock(out)
    assert not (tmp_path / "dangling").exists()


# ------------------------------------------------------------------------------ preflight
def _registered_cfg(synthetic_root, tmp_path, stage="braixdet", extra=()):
    from _train_helpers import CONFIGS, tiny_opts

    from braixdet.config import build_cfg, resolve_cfg

    cfg = build_cfg(CONFIGS[stage], tiny_opts(synthetic_root.root, tmp_path / "out",
                                              tmp_path / "cache", stage=stage, extra=extra))
    cfg = resolve_cfg(cfg)
    return cfg


def test_preflight_empty_validation_split_fails_before_training(synthetic_root, tmp_path):
    """Stage 1 evaluates on (val, test): with VAL_FRACTION 0 the validation split is empty. The
    run used to train, write model_final and only then fail in the final evaluation."""
    out = tmp_path / "out"
    opts = _tiny(synthetic_root, tmp_path, out, max_iter=2,
                 extra=["DATASETS.BRAIXDET.VAL_FRACTION", "0.0"])
    rc, last, err = _cli("mvccl", opts)
    assert rc == 1
    assert last == ("error: DATASETS.TEST: dataset 'cbis_ddsm_val_s0' is empty; it is the "
                    "validation split: raise DATASETS.BRAIXDET.VAL_FRACTION or set DATASETS.TEST "
                    "to other datasets"), err[-2000:]
    assert "Traceback" not in err
    assert not [f for f in os.listdir(out) if f.endswith(".pth") or f == "last_checkpoint"]
    assert "PreflightError" in (out / "log.txt").read_text()  # the traceback is in the log
    _assert_released(out)


@pytest.mark.parametrize("key,value,reason", [
    ("MODEL.WEIGHTS", "{tmp}/missing.pth", "MODEL.WEIGHTS: no such file {tmp}/missing.pth"),
    ("MODEL.WEIGHTS", "{tmp}/empty.pth", "MODEL.WEIGHTS: {tmp}/empty.pth is empty"),
    ("MODEL.WEIGHTS", "{tmp}", "MODEL.WEIGHTS: {tmp} is not a file"),
    ("MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", "{tmp}/stage1/model_final.pth",
     "MODEL.BRAIXDET.INIT_FROM_CLASSIFIER: no such file {tmp}/stage1/model_final.pth"),
    ("SSL.CAM_JSON", "{tmp}/cam.json", "SSL.CAM_JSON: no such file {tmp}/cam.json"),
    ("SSL.CAM_JSON", "{tmp}/bad.json", "SSL.CAM_JSON: {tmp}/bad.json is not valid JSON"),
    ("MODEL.BRAIXDET.PRETRAINED", "{tmp}/effnet.pth",
     "MODEL.BRAIXDET.PRETRAINED: no such file {tmp}/effnet.pth"),
    ("DATASETS.TRAIN_WEAK", "('no_such_dataset',)",
     "DATASETS.TRAIN_WEAK: dataset 'no_such_dataset' is not registered"),
    ("OUTPUT_DIR", "{tmp}/empty.pth/out", "OUTPUT_DIR: cannot write to {tmp}/empty.pth/out"),
])
def test_preflight_names_key_file_and_reason(synthetic_root, tmp_path, key, value, reason):
    from braixdet.engine.preflight import PreflightError, check_before_training

    (tmp_path / "empty.pth").write_bytes(b"")
    (tmp_path / "bad.json").write_text("{not json")
    extra = [key, value.format(tmp=tmp_path), "SSL.ENABLED", "True"]
    cfg = _registered_cfg(synthetic_root, tmp_path, extra=extra)
    with pytest.raises(PreflightError) as e:
        check_before_training(cfg)
    msg = str(e.value)
    assert msg.startswith(reason.format(tmp=tmp_path)) and "\n" not in msg, msg


def test_preflight_accepts_named_pretrained_sources_and_resume(synthetic_root, tmp_path):
    from braixdet.engine.preflight import PreflightError, check_before_training

    for source in ("imagenet", "efficientnet-lite0-package"):  # not files: left to the backbone
        cfg = _registered_cfg(synthetic_root, tmp_path,
                              extra=["MODEL.BRAIXDET.PRETRAINED", source])
        check_before_training(cfg)
    # --resume with a checkpoint in OUTPUT_DIR ignores MODEL.WEIGHTS (not read)
    cfg = _registered_cfg(synthetic_root, tmp_path,
                          extra=["MODEL.WEIGHTS", str(tmp_path / "gone.pth")])
    with pytest.raises(PreflightError):
        check_before_training(cfg, resume=True)
    (tmp_path / "out" / "last_checkpoint").write_text("model_0000001.pth")
    check_before_training(cfg, resume=True)
    with pytest.raises(PreflightError, match="MODEL.WEIGHTS: no such file"):
        check_before_training(cfg, eval_only=True)


@pytest.mark.parametrize("stage,extra,reason", [
    ("faster_rcnn", ["MODEL.BRAIXDET.LCM.EMBED_DIM", "64"],
     "MODEL.BRAIXDET.LCM.EMBED_DIM = 64 does nothing: this model has no LCM "
     "(MODEL.BRAIXDET.MULTI_VIEW False); leave it at 128"),
    ("braixdet", ["MODEL.BRAIXDET.GCM.ENABLED", "False"],
     "MODEL.BRAIXDET.GCM.ENABLED = False does nothing: this model has no GCM (a detector:"),
    ("braixdet", ["MODEL.BRAIXDET.LCM.ENABLED", "False"],
     "MODEL.BRAIXDET.LCM.EMBED_DIM = 32 does nothing: this model has no LCM (LCM.ENABLED False)"),
    ("mvccl", ["MODEL.BRAIXDET.GCM.ENABLED", "False", "MODEL.BRAIXDET.GCM.LOSS_WEIGHT", "0.5"],
     "MODEL.BRAIXDET.GCM.LOSS_WEIGHT = 0.5 does nothing: this model has no GCM (GCM.ENABLED "
     "False)"),
    # single view on top of the multi-view config: the LCM widths it sets would do nothing
    ("mvccl", ["MODEL.BRAIXDET.MULTI_VIEW", "False"],
     "MODEL.BRAIXDET.LCM.EMBED_DIM = 64 does nothing: this model has no LCM "
     "(MODEL.BRAIXDET.MULTI_VIEW False)"),
    ("mvccl", ["MODEL.BRAIXDET.MULTI_VIEW", "False", "MODEL.BRAIXDET.LCM.EMBED_DIM", "128",
               "MODEL.BRAIXDET.LCM.OUT_DIM", "128", "MODEL.BRAIXDET.GCM.LOSS_WEIGHT", "0.5"],
     "MODEL.BRAIXDET.GCM.LOSS_WEIGHT = 0.5 does nothing: this model has no GCM "
     "(MODEL.BRAIXDET.MULTI_VIEW False)"),
])
def test_preflight_refuses_keys_of_a_module_the_model_does_not_build(
        synthetic_root, tmp_path, stage, extra, reason):
    """An LCM.* or GCM.* value where the model builds no LCM or GCM would do nothing: refused
    before training, in one line; accepted where the module exists, and by --eval-only (a
    saved config of an older single-view run may carry the demo's LCM widths)."""
    from braixdet.config import ConfigValueError
    from braixdet.engine.preflight import check_before_training

    cfg = _registered_cfg(synthetic_root, tmp_path, stage=stage, extra=extra)
    with pytest.raises(ConfigValueError) as e:
        check_before_training(cfg)
    assert str(e.value).startswith(reason) and "\n" not in str(e.value), str(e.value)
    (tmp_path / "model.pth").write_bytes(b"x")
    cfg.defrost()
    cfg.MODEL.WEIGHTS = str(tmp_path / "model.pth")
    check_before_training(cfg, eval_only=True)


def test_preflight_accepts_module_keys_where_the_module_is_built(synthetic_root, tmp_path):
    from braixdet.engine.preflight import check_before_training

    check_before_training(_registered_cfg(synthetic_root, tmp_path, extra=[
        "MODEL.BRAIXDET.LCM.DROPOUT", "0.1", "MODEL.BRAIXDET.LCM.LR_FACTOR", "10.0"]))
    check_before_training(_registered_cfg(synthetic_root, tmp_path, stage="mvccl", extra=[
        "MODEL.BRAIXDET.GCM.LOSS_WEIGHT", "0.5"]))
    # the switches act where the architecture has the module, also when off
    check_before_training(_registered_cfg(synthetic_root, tmp_path, stage="mvccl", extra=[
        "MODEL.BRAIXDET.GCM.ENABLED", "False", "MODEL.BRAIXDET.LCM.ENABLED", "False",
        "MODEL.BRAIXDET.LCM.EMBED_DIM", "128", "MODEL.BRAIXDET.LCM.OUT_DIM", "128"]))


def test_preflight_disk_space(monkeypatch, tmp_path):
    import types

    import torch

    from braixdet.config import build_cfg
    from braixdet.engine import preflight

    cfg = build_cfg(opts=["OUTPUT_DIR", str(tmp_path), "SOLVER.MAX_ITER", "100",
                          "SOLVER.CHECKPOINT_PERIOD", "10"])
    model = torch.nn.Linear(1000, 1000)  # 4 MB of weights -> ~12 MB with Adam's moments
    trainer = types.SimpleNamespace(model=model, start_iter=0)
    assert preflight.checkpoint_size_estimate(model) == 3 * 1001 * 1000 * 4
    monkeypatch.setattr(preflight, "_free_bytes", lambda path: 20 << 20)
    with pytest.raises(preflight.PreflightError) as e:
        preflight.check_disk_space(cfg, trainer)
    assert str(e.value) == (f"OUTPUT_DIR: 20 MB free on {tmp_path}, a checkpoint needs about "
                            "29 MB; free some space or use another OUTPUT_DIR")
    monkeypatch.setattr(preflight, "_free_bytes", lambda path: 40 << 20)
    warnings = []
    monkeypatch.setattr(preflight.logger, "warning", lambda msg, *a: warnings.append(msg % a))
    preflight.check_disk_space(cfg, trainer)  # keeps 1 periodic + model_final: 24 MB, fits
    assert warnings == []
    cfg.defrost()
    cfg.SOLVER.BRAIXDET.CHECKPOINTS_KEPT = 0  # keep all 9 periodic + model_final: 120 MB
    preflight.check_disk_space(cfg, trainer)  # room for one: ok, with a warning
    assert warnings == [f"OUTPUT_DIR {tmp_path}: 40 MB free, the 10 checkpoints the run keeps "
                        "need about 115 MB, so the disk may fill up "
                        "(SOLVER.BRAIXDET.CHECKPOINTS_KEPT)"]


# ------------------------------------------------------------------------------ checkpoints
def _crafted(d):
    import pickle

    import torch
    from _train_helpers import PickledCode

    marker = d / "pwned"
    zipped = d / "model_final.pth"
    torch.save({"model": {"w": torch.zeros(1)}, "payload": PickledCode(str(marker))}, zipped)
    legacy = d / "legacy.pth"
    with open(legacy, "wb") as f:
        pickle.dump(PickledCode(str(marker)), f, protocol=2)
    pkl = d / "zoo.pkl"
    with open(pkl, "wb") as f:
        pickle.dump({"model": PickledCode(str(marker))}, f, protocol=2)
    return marker, zipped, legacy, pkl


def _refusal(path):
    return (f"refusing to load {path}: it contains Python objects other than tensors and plain "
            "values (weights_only)")


def test_refused_checkpoint_is_one_line_naming_the_file(tmp_path):
    import pickle

    import torch

    from braixdet.config import build_cfg
    from braixdet.engine.checkpoint import AtomicCheckpointer
    from braixdet.modeling.rcnn import load_classifier_weights_from_cfg
    from braixdet.utils.checkpoint import (
        CheckpointLoadError,
        CheckpointRefusedError,
        load_inference_weights,
    )

    marker, zipped, legacy, pkl = _crafted(tmp_path)
    model = torch.nn.Linear(1, 1)
    for path in (zipped, legacy):
        for load in (lambda p: load_inference_weights(model, str(p)),
                     lambda p: AtomicCheckpointer(model).load(str(p))):
            with pytest.raises(CheckpointRefusedError) as e:
                load(path)
            assert str(e.value) == _refusal(path)
            assert isinstance(e.value, pickle.UnpicklingError)  # as before, more precise
        cfg = build_cfg(opts=["MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", str(path)])
        with pytest.raises(CheckpointRefusedError) as e:
            load_classifier_weights_from_cfg(None, cfg)
        assert str(e.value) == _refusal(path)
    with pytest.raises(CheckpointRefusedError) as e:
        AtomicCheckpointer(model).load(str(pkl))
    assert str(e.value) == (f"refusing to load {pkl}: it contains the Python global "
                            "'io.open', not only numpy arrays and plain values (.pkl)")
    assert not marker.exists()
    # a truncated checkpoint: one line too
    good = tmp_path / "good.pth"
    torch.save({"model": model.state_dict()}, good)
    cut = tmp_path / "cut.pth"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointLoadError) as e:
        load_inference_weights(model, str(cut))
    assert str(e.value).startswith(f"cannot load checkpoint {cut}: not a complete PyTorch "
                                   "checkpoint") and "\n" not in str(e.value)


def test_refused_checkpoint_through_train_net(synthetic_root, tmp_path):
    """--eval-only with a crafted MODEL.WEIGHTS and a stage-2 run with a crafted
    INIT_FROM_CLASSIFIER both end with the one refusal line (traceback in the log only)."""
    d = tmp_path / "evil"
    d.mkdir()
    marker, zipped, legacy, _ = _crafted(d)
    out = tmp_path / "eval"
    opts = _tiny(synthetic_root, tmp_path, out, extra=["MODEL.WEIGHTS", str(zipped)])
    rc, last, err = _cli("mvccl", opts, "--eval-only")
    assert rc == 1 and last == f"error: {_refusal(zipped)}", err[-2000:]
    assert "Traceback" not in err
    assert "UnpicklingError" in (out / "log.txt").read_text()

    out = tmp_path / "stage2"
    opts = _tiny(synthetic_root, tmp_path, out, stage="faster_rcnn", init_from=legacy,
                 max_iter=1)
    rc, last, err = _cli("faster_rcnn", opts)
    assert rc == 1 and last == f"error: {_refusal(legacy)}", err[-2000:]
    assert not [f for f in os.listdir(out) if f.endswith(".pth")]
    assert not marker.exists()


class _FullDisk:
    """os.fdopen whose binary files raise ENOSPC once ``budget`` bytes were written."""

    def __init__(self, real_fdopen, budget=2000, only=""):
        self.real, self.budget, self.only = real_fdopen, budget, only

    def __call__(self, fd, mode="r", *a, **k):
        import errno
        import io

        f = self.real(fd, mode, *a, **k)
        name = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else ""
        if "b" not in mode or self.only not in os.path.basename(name):
            return f
        budget = [self.budget]

        class Full(io.BufferedWriter):
            def write(self, b):
                budget[0] -= len(b)
                if budget[0] < 0:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return super().write(b)

        return Full(f.detach())


@pytest.mark.parametrize("how", ["enospc_from_write", "torch_runtime_error"])
def test_checkpoint_write_failure_keeps_previous(tmp_path, monkeypatch, how):
    import torch

    from braixdet.engine import checkpoint as ck
    from braixdet.utils.checkpoint import CheckpointWriteError

    model = torch.nn.Linear(64, 64)
    saver = ck.AtomicCheckpointer(model, str(tmp_path))
    saver.save("model_0000000")
    before = (tmp_path / "model_0000000.pth").read_bytes()
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    if how == "enospc_from_write":
        monkeypatch.setattr(os, "fdopen", _FullDisk(os.fdopen))
    else:
        def failing_save(obj, f, *a, **k):
            f.write(b"PK\x03\x04 partial")
            raise RuntimeError("[enforce fail at inline_container.cc:603] . PytorchStreamWriter "
                               "failed writing file data/0: file write failed")

        monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(CheckpointWriteError) as e:
        saver.save("model_0000999")
    monkeypatch.undo()
    msg, path = str(e.value), tmp_path / "model_0000999.pth"
    what = "no space left on device" if how == "enospc_from_write" else "write failed ("
    assert msg.startswith(f"{what}") and f"while writing checkpoint {path} (free: " in msg, msg
    assert msg.endswith(" MB); the previous checkpoint is intact") and "\n" not in msg, msg
    assert sorted(os.listdir(tmp_path)) == ["last_checkpoint", "model_0000000.pth"]  # no temp
    assert (tmp_path / "last_checkpoint").read_text() == "model_0000000.pth"
    assert (tmp_path / "model_0000000.pth").read_bytes() == before
    fresh = torch.nn.Linear(64, 64)
    ck.AtomicCheckpointer(fresh, str(tmp_path)).resume_or_load("", resume=True)
    assert torch.equal(fresh.weight, saved)  # the state from before the failure


def test_disk_full_during_training_ends_with_one_line(synthetic_root, tmp_path, monkeypatch):
    """train_net: the second periodic checkpoint hits ENOSPC -> one error line last, the first
    checkpoint intact and resumable."""
    out = tmp_path / "out"
    opts = _tiny(synthetic_root, tmp_path, out, max_iter=3, ckpt_period=1,
                 extra=["DATASETS.TEST", "()"])
    monkeypatch.setattr(os, "fdopen", _FullDisk(os.fdopen, budget=0, only=".model_0000001.pth"))
    rc, last, err = _cli("mvccl", opts)
    monkeypatch.undo()
    assert rc == 1
    assert last.startswith("error: no space left on device while writing checkpoint "
                           f"{out}/model_0000001.pth (free: ") and \
        last.endswith("MB); the previous checkpoint is intact"), err[-3000:]
    assert sorted(f for f in os.listdir(out) if "model" in f) == ["model_0000000.pth"]
    assert (out / "last_checkpoint").read_text() == "model_0000000.pth"
    _assert_released(out)


# ------------------------------------------------------------------------------ nonsense intensity
@pytest.mark.parametrize("attrs,detail", [
    ({"RescaleSlope": "0"}, "RescaleSlope 0.0"),
    ({"RescaleSlope": "NaN"}, "RescaleSlope nan"),
    ({"RescaleSlope": "1e308"}, "RescaleSlope 1e+308"),
    ({"RescaleSlope": "-1e308"}, "RescaleSlope -1e+308"),
    ({"RescaleIntercept": "inf"}, "RescaleIntercept inf"),
])
def test_nonsense_rescale_refused_with_reason(tmp_path, attrs, detail):
    """Issue 21 item 8: these gave an all-black canonical image without a bad-input line."""
    from braixdet.data.dicom import read_dicom_image, write_dicom

    px = np.arange(64 * 48, dtype=np.uint16).reshape(64, 48)
    p = write_dicom(tmp_path / "x.dcm", px, **attrs)
    with pytest.raises(BadInputError) as e:
        read_dicom_image(p)
    assert e.value.reason == "bad_intensity" and detail in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    ok = write_dicom(tmp_path / "ok.dcm", px, RescaleSlope="2", RescaleIntercept="-100")
    assert read_dicom_image(ok)[0].max() == 1.0  # sane values still read


@pytest.mark.parametrize("side", [1, 2])
def test_tiny_images_refused(tmp_path, side):
    from braixdet.data.dicom import read_dicom_image, write_dicom

    p = write_dicom(tmp_path / "t.dcm", np.full((side, side), 7, np.uint16))
    with pytest.raises(BadInputError) as e:
        read_dicom_image(p)
    assert e.value.reason == "bad_dimensions" and "not a mammogram" in str(e.value)


# ------------------------------------------------------------------------------ config values
@pytest.mark.parametrize("key,value,allowed", [
    ("SOLVER.IMS_PER_BATCH", "0", "an integer >= 1"),
    ("DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH", "0", "an integer >= 1"),
    ("DATASETS.BRAIXDET.RATIO", "1/0", "a fraction in (0, 1] such as '1/8' or 0.125"),
    ("DATASETS.BRAIXDET.RATIO", "abc", "a fraction in (0, 1] such as '1/8' or 0.125"),
    ("DATASETS.BRAIXDET.FORMAT", "dicomdir", "one of 'cbis_ddsm', 'exam_csv', 'vindr_mammo'"),
    ("DATASETS.BRAIXDET.VAL_FRACTION", "1.5", "a number in [0, 1)"),
    ("INPUT.BRAIXDET.MASK_DOWNSAMPLE", "0", "an integer >= 1"),
    ("SSL.CAM_VIEW_AGREEMENT", "1.5", "a number in [0, 1)"),
])
def test_bad_config_value_is_one_line_before_any_data(synthetic_root, tmp_path, key, value,
                                                      allowed):
    """Issue 21 item 5: these ended in ZeroDivisionError / ValueError tracebacks (VAL_FRACTION
    1.5: an empty training split, exit 0). Now: one line naming key, value and what is allowed,
    before the output folder or the dataset is touched."""
    out = tmp_path / "out"
    opts = _tiny(synthetic_root, tmp_path, out, max_iter=1, extra=[key, value])
    rc, last, err = _cli("mvccl", opts)
    shown = repr(value) if not value.replace(".", "").isdigit() else value
    assert rc == 1 and last == f"error: {key} = {shown}: allowed: {allowed}", err[-2000:]
    assert "Traceback" not in err and err.count("error:") == 1
    assert not out.exists()


@pytest.mark.parametrize("key,value,line", [
    ("SOLVER.BRAIXDET.EPOCHS", "5", "error: config: Type mismatch (<class 'float'> vs. <class "
     "'int'>) with values (5.0 vs. 5) for config key: SOLVER.BRAIXDET.EPOCHS (write a float "
     "key's value as 5.0, not 5)"),
    ("SOLVER.NO_SUCH_KEY", "1", "error: config: Non-existent key: SOLVER.NO_SUCH_KEY: not a "
     "config key (--opts KEY VALUE ...)"),
])
def test_config_key_of_the_wrong_type_or_unknown_is_one_line(synthetic_root, tmp_path, key,
                                                              value, line):
    """--opts with an int for a float key (yacs refuses 5 where the config has 5.0) or a key that
    does not exist ended in an 'unexpected' error and yacs' traceback; now one line naming the
    key, before anything is written."""
    out = tmp_path / "out"
    opts = _tiny(synthetic_root, tmp_path, out, max_iter=1, extra=[key, value])
    rc, last, err = _cli("mvccl", opts)
    assert rc == 1 and last == line, err[-2000:]
    assert "Traceback" not in err and err.count("error:") == 1
    assert not out.exists()


def test_lesion_free_validation_split_refused_unless_opted_in(synthetic_root, tmp_path):
    """Issue 21 item 6: with split seed 4 the session's validation split has no lesion; it used
    to train to the end (AP NaN, "the last model exported")."""
    from braixdet.engine.preflight import check_before_training

    out = tmp_path / "out"
    opts = _tiny(synthetic_root, tmp_path, out, max_iter=2, extra=["DATASETS.BRAIXDET.SEED", "4"])
    rc, last, err = _cli("mvccl", opts)
    assert rc == 1 and last == (
        "error: DATASETS.TEST: validation dataset 'cbis_ddsm_val_s4' (2 images) has no lesion, "
        "so its AP/AUC is undefined; raise DATASETS.BRAIXDET.VAL_FRACTION, use another "
        "DATASETS.BRAIXDET.SEED, or set DATASETS.BRAIXDET.ALLOW_LESION_FREE_VAL True"), err[-2000:]
    assert not [f for f in os.listdir(out) if f.endswith(".pth")]
    for stage in ("braixdet", "mvccl"):  # the detector's split too; the opt-in key passes it
        seed4 = ["DATASETS.BRAIXDET.SEED", "4"]
        with pytest.raises(Exception, match="has no lesion"):
            check_before_training(_registered_cfg(synthetic_root, tmp_path / stage, stage,
                                                  extra=seed4))
        check_before_training(_registered_cfg(
            synthetic_root, tmp_path / stage, stage,
            extra=seed4 + ["DATASETS.BRAIXDET.ALLOW_LESION_FREE_VAL", "True"]))


def test_train_net_planted_symlinks_refused_before_anything_is_written(synthetic_root,
                                                                       tmp_path):
    """Issue 21 item 1: links at OUTPUT_DIR/config.yaml (overwritten), log.txt and metrics.json
    (appended) made train_net write outside its folder."""
    out, victims = tmp_path / "out", {}
    out.mkdir()
    for name in ("config.yaml", "log.txt", "metrics.json"):
        victims[name] = tmp_path / f"victim_{name}"
        victims[name].write_text("keep")
        os.symlink(victims[name], out / name)
        opts = _tiny(synthetic_root, tmp_path, out, max_iter=1)
        rc, last, err = _cli("mvccl", opts)
        assert rc == 1 and last.startswith(f"error: refusing to write {out / name}: it is a "
                                           "symbolic link"), err[-2000:]
        assert "Traceback" not in err
        assert all(v.read_text() == "keep" for v in victims.values())
        os.unlink(out / name)
    (out / ".lock").unlink()  # the refused runs above left the (empty, released) lock file
    os.symlink(tmp_path / "victim_lock", out / ".lock")
    rc, last, err = _cli("mvccl", _tiny(synthetic_root, tmp_path, out, max_iter=1))
    assert rc == 1 and last.startswith(f"error: refusing to write {out / '.lock'}: it is a "
                                       "symbolic link") and not (tmp_path / "victim_lock").exists()


def test_pipeline_shows_the_stages_error_line_not_its_traceback(tmp_path):
    """Issue 21 item 5 through run_pipeline.py: a bad stage-1 value used to end in the
    pipeline's own `RuntimeError: stage mvccl failed` traceback. Now the tool's last line is the
    stage's one-line error, exit 1, from the pipeline's check of every stage before the first
    runs (a bad --det-opts value would otherwise surface after stage 1)."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, os.path.join(repo, "tools", "run_pipeline.py"), "--root",
         str(tmp_path / "no_data"), "--configs", os.path.join(repo, "configs", "demo"),
         "--out", str(tmp_path / "o"), "--stage1-opts", "SOLVER.IMS_PER_BATCH", "0"],
        capture_output=True, text=True, timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert last == ("error: SOLVER.IMS_PER_BATCH = 0: allowed: an integer >= 1 "
                    "(stage mvccl)"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o" / "mvccl").exists()  # refused before any stage ran
    # a detector's value that does nothing on a single-view row: refused before stage 1
    from argparse import Namespace

    from braixdet.config import ConfigValueError
    from braixdet.pipeline import Pipeline

    pipe = Pipeline(Namespace(
        dataset="cbis_ddsm", root=str(tmp_path / "no_data"), csv="", protocol="partial",
        ratio="1/8", seed=0, out=str(tmp_path / "o"),
        configs=os.path.join(repo, "configs", "demo"), methods=["faster_rcnn_mv", "faster_rcnn"],
        num_gpus=1, num_machines=1, machine_rank=0, dist_url="auto", opts=[], stage1_opts=[],
        det_opts=["MODEL.BRAIXDET.LCM.LR_FACTOR", "10.0"]))
    with pytest.raises(ConfigValueError) as e:
        pipe.run_all()
    assert str(e.value) == (
        "MODEL.BRAIXDET.LCM.LR_FACTOR = 10.0 does nothing: this model has no LCM "
        "(MODEL.BRAIXDET.MULTI_VIEW False); leave it at 1.0 (stage faster_rcnn)")
    assert not (tmp_path / "o" / "mvccl").exists()
