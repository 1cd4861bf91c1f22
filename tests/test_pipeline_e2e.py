"""End to end: the two-stage pipeline on tiny synthetic DICOMs, exam inference, no identifiers.

One module-scoped pipeline run (tools/run_experiments.py, one seed, with the demo configs at
128x64, narrow heads and a few iterations per stage) feeds most tests here; the stop/resume and
full-protocol tests start from copies of its stage-1 folders.
"""
import json
import math
import os
import subprocess
import sys

import pytest
from _train_helpers import seed_as_train_net, tree_digest  # shared with test_reliability
from scipy import stats

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = ["INPUT.BRAIXDET.CANONICAL_SIZE", "(128, 64)", "INPUT.BRAIXDET.MASK_DOWNSAMPLE", "2"]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


# narrow heads (what predict.py must be told too: the weights' shapes)
# (the demo's widths: with 32-channel heads, near-tied detections made the shared and per-pair
# predictions differ beyond the tolerance of test_predict_same_with_or_without_feature_sharing)
MODEL_SHAPE = []
DET_OPTS = ["SOLVER.MAX_ITER", "3", "TEST.EVAL_PERIOD", "2", "SOLVER.CHECKPOINT_PERIOD", "1",
            "SSL.CAM_FUSION_ITERS", "2", "MODEL.RPN.POST_NMS_TOPK_TRAIN", "50",
            "MODEL.RPN.POST_NMS_TOPK_TEST", "50", "MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE", "32",
            *MODEL_SHAPE]
STAGE1_OPTS = ["SOLVER.MAX_ITER", "3", "TEST.EVAL_PERIOD", "0",
               "MODEL.BRAIXDET.CLS_HIDDEN_DIM", "32"]


def pipeline_argv(root, out, methods=("braixdet",), protocol="partial"):
    """tools/run_pipeline.py arguments of the tiny runs of this module (one seed, 0)."""
    return ["--dataset", "cbis_ddsm", "--root", str(root), "--ratio", "1/8", "--protocol",
            protocol, "--out", str(out), "--configs", os.path.join(REPO, "configs", "demo"),
            "--methods", *methods,
            "--opts", *SIZE, "SOLVER.IMS_PER_BATCH", "2", "SOLVER.CHECKPOINT_PERIOD", "100",
            "DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH", "2", "DATALOADER.NUM_WORKERS", "0",
            "--stage1-opts", *STAGE1_OPTS, "--det-opts", *DET_OPTS]


@pytest.fixture(scope="module")
def pipeline_run(synthetic_root, tmp_path_factory):
    """tools/run_experiments.py over one seed (a pipeline run with CAM only, Faster R-CNN and
    BRAIxDet); the tests below look at its pipeline folder and its summary."""
    exp = tmp_path_factory.mktemp("experiments")
    out = exp / "s0"
    before = tree_digest(synthetic_root.root)
    argv = pipeline_argv(synthetic_root.root, exp, ("cam_only", "faster_rcnn", "braixdet"))
    cmd = [sys.executable, os.path.join(REPO, "tools", "run_experiments.py"), "--seeds", "0",
           *argv]
    log = exp / "experiments.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    return {"out": out, "exp": exp, "log": text, "before": before,
            "root": synthetic_root.root, "summary": synthetic_root.summary}


ROWS = {"CAM only (LayerCAM res4)", "CAM only (GradCAM res5 (paper))", "Faster R-CNN",
        "BRAIxDet"}


def test_experiments_summarise_seeds_with_the_paper_table(pipeline_run):
    exp = pipeline_run["exp"]
    summary = json.loads((exp / "summary.json").read_text())
    assert summary["seeds"] == [0]
    assert {r["method"] for r in summary["rows"]} == ROWS
    md = (exp / "summary.md").read_text()
    assert "BRAIxDet (p-value vs " in md and "| mvccl |" in md and "not ranked" in md
    assert (exp / "s0" / "splits" / "cbis_ddsm_split_r1_8_s0.json").exists()


def test_paper_table_over_two_seeds(pipeline_run):
    """Two seeds (the run's and a shifted copy): mean ± std per row, BRAIxDet tested against
    the second best row by mean AP, as in the paper's tables."""
    from braixdet.pipeline.results import paper_table

    s0 = json.loads((pipeline_run["out"] / "results.json").read_text())
    s1 = json.loads(json.dumps(s0))
    s1["protocol"]["seed"] = 1
    for m in s1["results"].values():
        m.setdefault("bbox", m)["AP20"] = float(m.get("bbox", m)["AP20"]) + 2.0
    md, summary = paper_table([s0, s1])
    rows = {r["method"]: r for r in summary["rows"]}
    assert set(rows) == ROWS and all(r["n"] == 2 for r in rows.values())
    ap0 = float(s0["results"]["Faster R-CNN"].get("bbox", s0["results"]["Faster R-CNN"])["AP20"])
    assert rows["Faster R-CNN"]["AP20_mean"] == pytest.approx(ap0 + 1.0)
    assert rows["Faster R-CNN"]["AP20_std"] == pytest.approx(2 ** 0.5)
    others = {k: v["AP20_mean"] for k, v in rows.items() if k != "BRAIxDet"}
    assert summary["second_best"] == max(others, key=others.get)
    assert summary["seeds"] == [0, 1] and " ± " in md
    # the exam-level AUC column: both copies hold the same value -> its mean, std 0; none (a
    # one-class test split at this size gives null) -> n/a
    for label, m in s0["results"].items():
        auc = m.get("exam_AUC")
        line = next(x for x in md.splitlines() if x.startswith(f"| {label} |"))
        want = f"{float(auc):.1f} ± 0.0" if auc is not None else "n/a"
        assert line.split(" | ")[-2] == want, line
    # the run time column: each row's own stage, CPU minutes, mean over the seeds
    cpu = s0["row_cpu_seconds"]
    assert set(cpu) == ROWS and all(v > 0 for v in cpu.values())
    line = next(x for x in md.splitlines() if x.startswith("| BRAIxDet |"))
    assert line.split(" | ")[-1] == f"{cpu['BRAIxDet'] / 60:.1f} |", line
    assert line.split(" | ")[1] == "2", line  # the seeds column
    # the p-value row: unpaired one-tailed Welch t-test against the second best row, as scipy
    second = summary["second_best"]
    ap = {k: [float(s["results"][k].get("bbox", s["results"][k])["AP20"]) for s in (s0, s1)]
          for k in ("BRAIxDet", second)}
    want = stats.ttest_ind(ap["BRAIxDet"], ap[second], equal_var=False, alternative="greater")
    line = next(x for x in md.splitlines() if x.startswith("| BRAIxDet (p-value vs "))
    cell = "n/a" if math.isnan(want.pvalue) else f"{want.pvalue:.4f}"
    cells = [c.strip() for c in line.strip("|").split("|")]  # label, seeds, AP20 p, R@0.5 p
    assert "one-tailed Welch t-test" in cells[0] and cells[1:3] == ["", cell], line


def test_pipeline_produces_every_artefact(pipeline_run):
    out = pipeline_run["out"]
    for rel in ["mvccl/model_final.pth", "mvccl/model_export.pth",
                "classifier_single_view/model_final.pth", "mvccl/gradcam_pseudo_boxes.json",
                "braixdet/model_export.pth", "faster_rcnn/model_export.pth", "results.json",
                "mvccl/stage_done.json", "gradcam/stage_done.json", "braixdet/stage_done.json"]:
        assert (out / rel).exists(), rel
    summary = json.loads((out / "results.json").read_text())
    res = summary["results"]
    # the demo configs use LayerCAM at res4: the paper's GradCAM at res5 is scored too
    assert set(res) == ROWS
    for name, metrics in res.items():
        m = metrics.get("bbox", metrics)
        for key in ("AP20", "R@0.5"):
            assert math.isfinite(float(m[key])), (name, key, m)
    assert set(summary["classifiers"]) == {"mvccl", "classifier_single_view"}
    assert "AUC" in summary["classifiers"]["mvccl"]["test"]  # None when one class only
    assert summary["cam_quality"]["images_with_known_lesions"] >= 0
    # stage 2 starts from the stage-1 classifier selected on validation (issue 20 item 5)
    assert summary["stage1_models"]["mvccl"] == str(out / "mvccl" / "model_export.pth")
    # evaluator artefacts: FROC curve (CSV + PNG) and COCO-style detections, per method
    for stage in ("braixdet", "faster_rcnn", "cam_only_layercam_res4"):
        files = {f for _, _, fs in os.walk(out / stage) for f in fs}
        assert {"froc.csv", "froc.png", "detections_coco.json", "metrics.json"} <= files, stage
    assert "| Method | AP@IoU0.2 (%) | Recall@0.5 FPPI (%) | exam AUC (%) |" in pipeline_run["log"]
    assert "##### seed 0 (1/1)" in pipeline_run["log"]  # progress while it runs


def test_baseline_starts_from_the_single_view_classifier(pipeline_run):
    """Paper Table 6 row 2: the Faster R-CNN baseline's encoder is a single-view classifier
    pre-trained on D_s ∪ D_w, not ImageNet alone; the multi-view rows start from BRAIxMVCCL."""
    out = pipeline_run["out"]
    frcnn = (out / "logs" / "faster_rcnn.log").read_text()
    assert f"Initialised detector from classifier {out / 'classifier_single_view'}" in frcnn
    bx = (out / "logs" / "braixdet.log").read_text()
    assert f"Initialised detector from classifier {out / 'mvccl' / 'model_export.pth'}" in bx
    single = (out / "classifier_single_view" / "config.yaml").read_text()
    assert "MULTI_VIEW: false" in single


def test_rerun_skips_finished_stages(pipeline_run, tmp_path):
    """A second run of a finished pipeline trains nothing (each stage's output exists); a link
    planted at its results.json is replaced by the file, its target untouched (issue 21.1)."""
    out = pipeline_run["out"]
    mtime = os.path.getmtime(out / "braixdet" / "model_export.pth")
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.replace(out / "results.json", tmp_path / "results.json")
    os.symlink(victim, out / "results.json")
    cmd = [sys.executable, os.path.join(REPO, "tools", "run_pipeline.py"), "--dataset",
           "cbis_ddsm", "--root", str(pipeline_run["root"]), "--out", str(out),
           "--configs", os.path.join(REPO, "configs", "demo"), "--opts", *SIZE]
    text = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                          check=True).stdout
    for stage in ("mvccl", "gradcam", "braixdet"):
        assert f"[{stage}] skipped" in text
    assert os.path.getmtime(out / "braixdet" / "model_export.pth") == mtime
    assert victim.read_text() == "keep" and not (out / "results.json").is_symlink()
    assert json.loads((out / "results.json").read_text())["results"]


def test_dataset_folder_never_written(pipeline_run):
    assert tree_digest(pipeline_run["root"]) == pipeline_run["before"]


def _identifiers(summary):
    ids = set()
    for rec in summary["truth"]:
        ids.update({rec["PatientName"], rec["PatientID"], rec["PatientBirthDate"]})
        ids.add(rec["PatientName"].replace("^", " "))
    return {i for i in ids if i}


def test_no_patient_identifiers_in_outputs(pipeline_run):
    """PatientName, PatientBirthDate and raw PatientID appear in no log, report, JSON or
    checkpoint (including checkpoint metadata) of the run."""
    needles = [s.encode() for s in _identifiers(pipeline_run["summary"])]
    assert needles
    hits = []
    for dirpath, _, files in os.walk(pipeline_run["out"]):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                data = f.read()
            hits += [(path, n.decode()) for n in needles if n in data]
    assert not hits, hits[:5]


@pytest.fixture(scope="module")
def predictions(pipeline_run, tmp_path_factory):
    """tools/predict.py over the synthetic test DICOMs, with and without shared features."""
    root, out = pipeline_run["root"], pipeline_run["out"]
    test_dirs = sorted({os.path.join(root, r["path"]).split("/1.3.6")[0]
                        for r in pipeline_run["summary"]["truth"] if r["split"] == "test"})
    results = {}
    for mode in ("shared", "per_pair"):
        dest = tmp_path_factory.mktemp(mode)
        cmd = [sys.executable, os.path.join(REPO, "tools", "predict.py"), "--config-file",
               os.path.join(REPO, "configs", "demo", "BRAIxDet", "braixdet.yaml"), "--weights",
               str(out / "braixdet" / "model_export.pth"), "--input", *test_dirs[:8], "--out",
               str(dest), "--score-thresh", "0.0", *SIZE, *MODEL_SHAPE]
        if mode == "per_pair":
            cmd.insert(-len(SIZE) - len(MODEL_SHAPE), "--no-share-features")
        subprocess.run(cmd, cwd=REPO, env=_env(), check=True, capture_output=True)
        results[mode] = (dest, json.loads((dest / "predictions.json").read_text()))
    return results


def test_predict_same_with_or_without_feature_sharing(predictions):
    (_, shared), (_, per_pair) = predictions["shared"], predictions["per_pair"]
    a = {r["sop_instance_uid"]: r for r in shared["images"]}
    b = {r["sop_instance_uid"]: r for r in per_pair["images"]}
    assert a.keys() == b.keys() and len(a) == 8
    for uid in a:
        da, db = a[uid]["detections"], list(b[uid]["detections"])
        assert len(da) == len(db)
        # same detections as a multiset: near-equal scores may come out in another order
        for x in da:
            match = [i for i, y in enumerate(db) if abs(x["score"] - y["score"]) <= 1e-4
                     and x["box_xyxy"] == pytest.approx(y["box_xyxy"], abs=0.2)]
            assert match, (uid, x)
            db.pop(match[0])


def test_predict_exam_keys_link_to_nothing_outside_their_run(predictions):
    """The same exams in two runs get different keys (a fixed hash of patient and study could
    be reversed by enumerating PatientIDs); inside one run each exam has its own key."""
    keys = {mode: [(e["exam"], e["key"]) for e in pred["exams"]]
            for mode, (_, pred) in predictions.items()}
    shared, per_pair = keys["shared"], keys["per_pair"]
    assert [n for n, _ in shared] == [n for n, _ in per_pair] and len(shared) >= 2
    assert len({k for _, k in shared}) == len(shared)
    assert not {k for _, k in shared} & {k for _, k in per_pair}


def test_predict_output_is_identifier_free_and_in_original_pixels(predictions, pipeline_run):
    dest, pred = predictions["shared"]
    needles = _identifiers(pipeline_run["summary"])
    text = (dest / "predictions.json").read_text()
    assert not [n for n in needles if n in text]
    for rec in pred["images"]:
        assert rec["laterality"] in ("L", "R") and rec["view"] in ("CC", "MLO")
        for det in rec["detections"]:
            x0, y0, x1, y1 = det["box_xyxy"]
            assert 0 <= x0 <= x1 <= rec["width"] and 0 <= y0 <= y1 <= rec["height"]
    assert len(list(dest.glob("*.png"))) == len(pred["images"])


def _iou(a, b):
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def test_predict_boxes_land_on_lesions_after_brief_training(synthetic_root, tmp_path, load_tool):
    """A multi-view detector overfitted briefly on the malignant training images finds their
    lesions again through tools/predict.py, at the lesions' ORIGINAL DICOM pixel positions."""
    from detectron2.data import DatasetCatalog

    from braixdet.config import build_cfg, register_datasets, resolve_cfg
    from braixdet.engine import BRAIxDetTrainer
    from braixdet.utils.checkpoint import export_model_only

    predict = load_tool("predict")

    root = str(synthetic_root.root)
    opts = ["DATASETS.BRAIXDET.ROOT", root, "DATASETS.BRAIXDET.PROTOCOL", "full",
            "DATASETS.BRAIXDET.SPLIT_DIR", str(tmp_path / "splits"),
            "INPUT.BRAIXDET.CACHE_DIR", str(tmp_path / "cache"), "OUTPUT_DIR", str(tmp_path / "o"),
            "SSL.ENABLED", "False", "MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", "", *SIZE,
            "INPUT.BRAIXDET.AUG.ENABLED", "False", "SOLVER.MAX_ITER", "50",
            "SOLVER.BASE_LR", "0.002", "SOLVER.WARMUP_ITERS", "5", "SOLVER.IMS_PER_BATCH", "4",
            "SOLVER.CHECKPOINT_PERIOD", "1000", "TEST.EVAL_PERIOD", "0"]
    cfg = build_cfg(os.path.join(REPO, "configs", "demo", "BRAIxDet", "braixdet.yaml"), opts)
    cfg = resolve_cfg(cfg)
    names = register_datasets(cfg)
    malignant = [d for d in DatasetCatalog.get(names["train_full"]) if d.get("annotations")]
    assert len(malignant) >= 4
    DatasetCatalog.register("e2e_overfit_malignant", lambda: malignant)
    cfg.DATASETS.TRAIN, cfg.DATASETS.TEST = ("e2e_overfit_malignant",), ()
    seed_as_train_net(cfg)
    trainer = BRAIxDetTrainer(cfg)
    trainer.resume_or_load(resume=False)
    trainer.train()
    weights = str(tmp_path / "detector.pth")
    export_model_only(trainer.model, weights)

    folders = sorted({os.path.dirname(d["file_name"]) for d in malignant})
    dest = tmp_path / "pred"
    config = os.path.join(REPO, "configs", "demo", "BRAIxDet", "braixdet.yaml")
    predict.main(["--config-file", config,
                  "--weights", weights, "--input", *folders, "--out", str(dest),
                  "--score-thresh", "0.0", "--no-overlays", *SIZE])
    pred = json.loads((dest / "predictions.json").read_text())["images"]
    import pydicom

    sop_to_boxes = {}
    for d in malignant:
        uid = str(pydicom.dcmread(d["file_name"], stop_before_pixels=True).SOPInstanceUID)
        sop_to_boxes[uid] = [a["bbox"] for a in d["annotations"]]
    hits = 0
    for rec in pred:
        gts = sop_to_boxes.get(rec["sop_instance_uid"])
        if gts is None or not rec["detections"]:
            continue
        top = max(rec["detections"], key=lambda r: r["score"])["box_xyxy"]
        hits += any(_iou(top, g) >= 0.2 for g in gts)
    assert hits >= 0.6 * len(sop_to_boxes), (hits, len(sop_to_boxes))


@pytest.mark.parametrize("configs,first", [("configs", "GradCAM res5 (paper)"),
                                           ("configs/demo", "LayerCAM res4")])
def test_cam_only_rows_show_the_paper_and_the_localising_heatmap(tmp_path, monkeypatch,
                                                                 configs, first, load_tool):
    """Whatever Algorithm 1 variant the stage-1 config uses, the CAM-only rows score it first,
    then the paper's GradCAM res5 and LayerCAM res4, each once (issue: show both)."""
    run_pipeline = load_tool("run_pipeline")

    pipe = run_pipeline.Pipeline(run_pipeline.parse_args(
        ["--root", str(tmp_path), "--out", str(tmp_path / "out"), "--methods", "cam_only",
         "--configs", os.path.join(REPO, configs)]))
    scored = []

    def fake_stage(name, cmd):  # the gradcam tool's --evaluate run, without a classifier
        scored.append((cmd[cmd.index("MODEL.BRAIXDET.CAM.METHOD") + 1],
                       cmd[cmd.index("MODEL.BRAIXDET.CAM.TARGET_LAYER") + 1]))
        out = cmd[cmd.index("--eval-out") + 1]
        os.makedirs(out)
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump({"bbox": {"AP20": float(len(scored))}}, f)

    monkeypatch.setattr(pipe, "run", fake_stage)
    rows = pipe.cam_only("unused.pth")
    assert sorted(scored) == [("gradcam", "res5"), ("layercam", "res4")]
    assert list(rows)[0] == f"CAM only ({first})"
    assert set(rows) == {"CAM only (GradCAM res5 (paper))", "CAM only (LayerCAM res4)"}


def _copy_stage1(src, dest, stages=("mvccl", "classifier_single_view", "gradcam")):
    """A pipeline folder holding only ``src``'s finished stage-1 stages (and pseudo-boxes)."""
    import shutil

    for stage in stages:
        shutil.copytree(src / stage, dest / stage, symlinks=True)


def _processes_mentioning(text):
    """PIDs of live processes whose command line contains ``text``."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def test_sigterm_stops_the_stage_and_a_rerun_resumes_to_the_same_table(pipeline_run, tmp_path):
    """Issue 21 items 3 and 11: SIGTERM to run_pipeline.py during stage 2 (after its first
    checkpoint) stops the stage's whole process group: exit 143, no process left, the
    OUTPUT_DIR lock free, no done-marker (although model_export.pth may exist). The re-run
    resumes from last_checkpoint and ends with the uninterrupted run's BRAIxDet metrics."""
    import signal
    import time

    from braixdet.utils.output_lock import acquire_output_lock

    out = tmp_path / "stopped"
    _copy_stage1(pipeline_run["out"], out)
    cmd = [sys.executable, os.path.join(REPO, "tools", "run_pipeline.py"),
           *pipeline_argv(pipeline_run["root"], out, ("braixdet",))]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "braixdet" / "last_checkpoint").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        text = proc.communicate(timeout=90)[0]
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert "[braixdet] stopped by signal" in text
    assert not _processes_mentioning(str(out)), "a stage process outlived the pipeline"
    assert not (out / "braixdet" / "stage_done.json").exists()
    acquire_output_lock(str(out / "braixdet")).release()  # free: no stale owner

    text = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                          check=True).stdout
    assert "[mvccl] skipped" in text and "[braixdet] skipped" not in text
    log = (out / "logs" / "braixdet.log").read_text()
    assert "Resuming from" in log or "resum" in log.lower(), log[-2000:]
    got = json.loads((out / "results.json").read_text())["results"]["BRAIxDet"]
    want = json.loads((pipeline_run["out"] / "results.json").read_text())["results"]["BRAIxDet"]
    assert got == want


@pytest.fixture
def run_pipeline_main(load_tool):
    """tools/run_pipeline.py's main() in this process (its output goes to capsys)."""
    return load_tool("run_pipeline").main


def test_full_protocol_trains_braixdet_as_its_supervised_detector(pipeline_run, tmp_path, capsys,
                                                                  run_pipeline_main):
    """Issue 20 item 1: --protocol full (D_w empty) runs through run_pipeline.main(); BRAIxDet
    trains as its supervised multi-view detector on every box, and the pipeline says so.
    Stage 1 (trained on D_s ∪ D_w, the same images under both protocols) is copied."""
    out = tmp_path / "full"
    _copy_stage1(pipeline_run["out"], out, ("mvccl",))
    # (Faster R-CNN under the full protocol: test_ceiling_is_faster_rcnn_on_every_box_...)
    summary = run_pipeline_main(pipeline_argv(pipeline_run["root"], out, ("braixdet",),
                                              protocol="full"))
    text = capsys.readouterr().out
    assert set(summary["results"]) == {"BRAIxDet"}
    # the synthetic source has no weakly annotated cases: no pseudo-box, supervised training
    assert "[gradcam] skipped: the full protocol's D_w holds no image" in text
    assert summary["cam_quality"] is None and not (out / "gradcam").exists()
    import yaml

    assert yaml.safe_load((out / "braixdet" / "config.yaml").read_text())["SSL"]["ENABLED"] is False
    for m in summary["results"].values():
        assert math.isfinite(float(m.get("bbox", m)["AP20"]))


def test_ceiling_is_faster_rcnn_on_every_box_of_the_same_split(pipeline_run, tmp_path, capsys):
    """Issue 27 item 6: the full-label ceiling of a finished 1/8 run (pipeline/ceiling.py):
    stage 1 copied from that run, not retrained; Faster R-CNN under the full protocol on every
    training image of the run's train_all; the same validation and test images; one row."""
    import argparse

    from braixdet.pipeline import add_pipeline_arguments
    from braixdet.pipeline.ceiling import run_ceiling, split_ids
    from braixdet.pipeline.results import CEILING

    run = pipeline_run["out"]
    args = add_pipeline_arguments(argparse.ArgumentParser()).parse_args(
        pipeline_argv(pipeline_run["root"], run, ("faster_rcnn",)))
    out = tmp_path / "ceiling"
    summary = run_ceiling(args, str(out))
    text = capsys.readouterr().out
    assert f"[classifier_single_view] skipped: {out / 'classifier_single_view'} is done" in text
    assert tree_digest(str(out / "classifier_single_view")) == \
        tree_digest(str(run / "classifier_single_view"))
    assert set(summary["results"]) == set(summary["row_cpu_seconds"]) == {CEILING}
    assert math.isfinite(float(summary["results"][CEILING]["bbox"]["AP20"]))
    roles = ("train_full", "train_weak", "train_all", "val", "test")
    partial, full = split_ids(str(run), roles), split_ids(str(out), roles)
    assert full["train_weak"] == [] and sorted(full["train_full"]) == sorted(partial["train_all"])
    assert len(partial["train_full"]) < len(full["train_full"])
    assert (full["val"], full["test"]) == (partial["val"], partial["test"])


def test_demo_refuses_a_ceiling_without_a_run_to_share(load_tool, tmp_path):
    """The ceiling reuses a run's split and stage 1: tools/run_demo.py's main() refuses it alone,
    before it writes anything."""
    with pytest.raises(SystemExit, match="--methods ceiling needs another row"):
        load_tool("run_demo").main(["--quick", "--out", str(tmp_path), "--methods", "ceiling"])
    assert os.listdir(tmp_path) == []


def test_competitors_run_through_run_pipeline_main(pipeline_run, tmp_path, capsys,
                                                   run_pipeline_main):
    """Issue 22: STAC, Unbiased Teacher and Soft Teacher as rows of run_pipeline.main(), from
    the single-view classifier; STAC labels D_w with the Faster R-CNN row's export (copied here
    with the classifier, so only the three competitors train) and reports its own student."""
    out = tmp_path / "competitors"
    _copy_stage1(pipeline_run["out"], out, ("classifier_single_view", "faster_rcnn"))
    methods = ("stac", "unbiased_teacher", "soft_teacher")
    # burn-in of 1 (demo: 20) so that the 3 iterations reach the pseudo-labelled steps
    summary = run_pipeline_main([*pipeline_argv(pipeline_run["root"], out, methods),
                                 "SSL.BURN_IN_ITERS", "1"])
    text = capsys.readouterr().out
    assert "[faster_rcnn] skipped" in text and "[mvccl]" not in text
    assert set(summary["results"]) == {"STAC", "Unbiased Teacher", "Soft Teacher"}
    for m in summary["results"].values():
        assert math.isfinite(float(m.get("bbox", m)["AP20"]))
    stac = (out / "logs" / "stac.log").read_text()
    assert str(out / "faster_rcnn" / "model_export.pth") in stac
    for m in methods:
        logged = (out / m / "metrics.json").read_text()
        assert '"weak_loss_cls"' in logged and '"ssl/pseudo_boxes"' in logged, m


def _readme_commands():
    """(tool, argv) of every `python tools/X.py ...` command in README.md's code blocks."""
    import re
    import shlex

    text = open(os.path.join(REPO, "README.md")).read().replace("\\\n", " ")
    cmds = []
    for line in text.splitlines():
        m = re.match(r"\s*python tools/(\w+)\.py\b(.*)", line)
        if m and "..." not in m.group(2):
            cmds.append((m.group(1), shlex.split(m.group(2).split("#")[0])))
    return cmds


def test_readme_pipeline_commands_parse_and_name_existing_configs(load_tool):
    """The README's tools/ commands parse with today's parsers; the pipeline ones name methods
    and config files that exist (a renamed flag or method fails here, not on a user's run)."""
    from detectron2.engine import default_argument_parser

    from braixdet.pipeline import METHODS, STAGE1, Pipeline

    cmds = _readme_commands()
    assert {t for t, _ in cmds} >= {"run_pipeline", "run_experiments", "prepare_dataset",
                                    "train_net", "gradcam_pseudo_labels"}
    for tool, argv in cmds:
        if tool == "train_net":
            args = default_argument_parser().parse_args(argv)
            assert os.path.exists(os.path.join(REPO, args.config_file))
            continue
        mod = load_tool(tool)
        if not hasattr(mod, "parse_args"):
            continue  # parsed inside main(): covered by its own tests
        args = mod.parse_args(argv)
        if tool in ("run_pipeline", "run_experiments"):
            pipe = Pipeline(args)
            for m in args.methods:
                if m in METHODS:
                    assert os.path.exists(pipe.config(METHODS[m].config)), m
            assert all(os.path.exists(pipe.config(c)) for c in STAGE1.values())


def test_a_method_that_needs_another_methods_export_runs_after_it(monkeypatch, tmp_path):
    """METHODS entries with teacher_from (e.g. STAC's first detector): the pipeline trains the
    dependency first and passes its export under teacher_key; cycles and half-given pairs are
    refused."""
    from braixdet.pipeline import Pipeline, method_order
    from braixdet.pipeline import methods as m

    monkeypatch.setitem(m.METHODS, "two_step", m.Method(
        "Two step", "baselines/faster_rcnn.yaml", "classifier_single_view",
        teacher_from="faster_rcnn", teacher_key="MODEL.WEIGHTS"))
    assert method_order(["two_step", "braixdet"]) == ["faster_rcnn", "two_step", "braixdet"]
    monkeypatch.setitem(m.METHODS, "faster_rcnn", m.Method(
        "loop", "baselines/faster_rcnn.yaml", "mvccl", teacher_from="two_step",
        teacher_key="MODEL.WEIGHTS"))
    with pytest.raises(ValueError, match="cycle"):
        method_order(["two_step"])
    with pytest.raises(ValueError, match="go together"):
        m.Method("x", "c.yaml", "mvccl", teacher_from="faster_rcnn")
    with pytest.raises(ValueError, match="init"):
        m.Method("x", "c.yaml", "imagenet")

    pipe = Pipeline(__import__("argparse").Namespace(
        dataset="cbis_ddsm", root=str(tmp_path), csv="", protocol="partial", ratio="1/8",
        seed=0, out=str(tmp_path / "o"), configs=os.path.join(REPO, "configs", "demo"),
        methods=["two_step"], num_gpus=1, num_machines=1, machine_rank=0, dist_url="auto",
        opts=[], stage1_opts=[], det_opts=[]))
    trained = []
    monkeypatch.setattr(pipe, "train", lambda name, config, opts: trained.append((name, opts)))
    monkeypatch.setattr("braixdet.pipeline.core.read_metrics", lambda folder: {})
    pipe.detector("two_step", {"classifier_single_view": "cls.pth", "mvccl": "mv.pth"}, "")
    opts = trained[0][1]
    assert opts[opts.index("MODEL.WEIGHTS") + 1] == str(tmp_path / "o" / "faster_rcnn" /
                                                          "model_export.pth")



def test_a_resumed_stage_reports_the_time_of_its_earlier_attempts(monkeypatch, tmp_path):
    """A stage trained across sessions: its done-marker's run time (the table's CPU-time column)
    adds what the attempts before its resume spent, as train_net's TrainingTimeHook hands it on,
    to the last attempt's own."""
    from braixdet.engine.hooks import TrainingTimeHook
    from braixdet.pipeline import Pipeline
    from braixdet.pipeline.stages import done_marker, read_json

    def resumed_stage(name, cmd, log_path):  # train_net resuming at iteration 300
        out = cmd[cmd.index("OUTPUT_DIR") + 1]
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, TrainingTimeHook.EARLIER_ATTEMPTS), "w") as f:
            json.dump({"from_iteration": 300, "seconds": 2000.0, "cpu_seconds": 3000.0}, f)
        return 0.0  # run_stage's CPU seconds of this attempt

    monkeypatch.setattr("braixdet.pipeline.core.run_stage", resumed_stage)
    pipe = Pipeline(__import__("argparse").Namespace(
        dataset="cbis_ddsm", root=str(tmp_path), csv="", protocol="partial", ratio="1/8",
        seed=0, out=str(tmp_path / "o"), configs=os.path.join(REPO, "configs", "demo"),
        methods=["braixdet"], num_gpus=1, num_machines=1, machine_rank=0, dist_url="auto",
        opts=[], stage1_opts=[], det_opts=[]))
    marker = read_json(done_marker(pipe.train("braixdet", "c.yaml", [])))
    assert 2000.0 <= marker["seconds"] < 2010.0
    assert 3000.0 <= marker["cpu_seconds"] < 3010.0

# ------------------------------------------------------------------ cluster launcher (issue 32)
def _fresh_install(tmp_path):
    """A fresh virtual environment holding braixdet installed non-editable (pip builds it from a
    copy of the checkout's package files); torch, detectron2 and submitit come from this
    interpreter's site-packages through a plain path line (not a site dir, so the editable
    braixdet installed there is not loaded). Returns its python."""
    import shutil
    import site

    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), src / name)
    for name in ("configs", "projects"):
        shutil.copytree(os.path.join(REPO, name), src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path("
                              "'purelib'))"], capture_output=True, text=True, check=True)
    with open(os.path.join(purelib.stdout.strip(), "_base.pth"), "w") as f:
        f.write(site.getsitepackages()[0] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-build-isolation", "--no-index",
                    "--disable-pip-version-check", str(src)], check=True, capture_output=True)
    return str(python), purelib.stdout.strip()


def _task_of(controller_pid):
    """The job process a local submitit job's controller started (its one task)."""
    with open(f"/proc/{controller_pid}/task/{controller_pid}/children") as f:
        return int(f.read().split()[0])


def test_local_launcher_from_an_installed_package_requeues_to_the_same_table(pipeline_run,
                                                                            tmp_path, capsys):
    """Issue 32: a grid of 1 seed x 1 row (Faster R-CNN), its stages copied from pipeline_run
    and summarised in process (run_experiments: nothing to train), then the same grid with the
    package installed non-editable in a fresh environment, from a folder outside the
    repository, as ``python -m braixdet.pipeline.experiments --launcher local``, starting from
    copies of those stages without Faster R-CNN's. Only that stage's job and the summary job run
    (done stages are not submitted); the job gets submitit's preemption signal after its first
    checkpoint, is requeued and resumes from it; the table equals the in-process run's (the
    same numbers: the resumed data order replays). The summary over several seeds is
    test_paper_table_over_two_seeds's, the job graph of several seeds the dry run's."""
    import re
    import shutil
    import signal
    import time

    from braixdet.pipeline import experiments

    grid = ("faster_rcnn",)
    ref = tmp_path / "inprocess"
    shutil.copytree(pipeline_run["out"], ref / "s0", symlinks=True)
    experiments.run(experiments.parse_args([*pipeline_argv(pipeline_run["root"], ref, grid),
                                            "--seeds", "0"]))
    capsys.readouterr()
    assert json.loads((ref / "summary.json").read_text())["seeds"] == [0]

    python, site_dir = _fresh_install(tmp_path)
    exp = tmp_path / "exp"
    missing = exp / "s0" / "faster_rcnn"
    shutil.copytree(ref / "s0", exp / "s0", symlinks=True)
    shutil.rmtree(missing)
    (exp / "s0" / "logs" / "faster_rcnn.log").unlink()  # the requeued run writes it again
    (exp / "s0" / "results.json").unlink()  # the summary job writes it again
    argv = pipeline_argv(pipeline_run["root"], exp, grid)
    argv[argv.index("--configs") + 1] = "demo"  # the packaged configs
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in _env().items() if k != "PYTHONPATH"}
    log = tmp_path / "launcher.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [python, "-m", "braixdet.pipeline.experiments", "--seeds", "0", *argv,
             "--launcher", "local", "--gpus-per-job", "0", "--timeout-min", "20"],
            cwd=elsewhere, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 400
            while not (missing / "last_checkpoint").exists():
                assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
                time.sleep(0.05)
            job = int(re.search(r"\[s0/faster_rcnn\] local job (\d+)", log.read_text())[1])
            os.kill(_task_of(job), signal.SIGUSR2)  # what submitit's controller sends at timeout
            assert proc.wait(timeout=400) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    jobs = [line for line in text.splitlines() if "local job" in line]
    assert [j.split("]")[0] for j in jobs] == ["=== [s0/faster_rcnn", "=== [summary"], text
    job_log = (exp / "submitit" / str(job) / f"{job}_0_log.out").read_text()
    assert "Requeued job" in job_log, job_log[-2000:]
    stage_log = (exp / "s0" / "logs" / "faster_rcnn.log").read_text()  # the requeued run's
    start = re.search(r"Starting training from iteration (\d+)", stage_log)
    assert start and int(start.group(1)) > 0, stage_log[-2000:]
    # done stages were not run again; the installed package's own configs were used
    done = sorted(str(p.relative_to(ref)) for p in ref.glob("s*/*/stage_done.json"))
    assert "s0/classifier_single_view/stage_done.json" in done, done
    for marker in done:
        if marker != "s0/faster_rcnn/stage_done.json":
            assert (exp / marker).read_bytes() == (ref / marker).read_bytes(), marker
    marker = json.loads((missing / "stage_done.json").read_text())
    assert marker["config"].startswith(os.path.join(site_dir, "braixdet", "configs", "demo"))
    # as text: a one-class split's AUC is NaN (!= NaN)
    assert json.dumps(json.loads((exp / "s0" / "results.json").read_text())["results"]) == \
        json.dumps(json.loads((ref / "s0" / "results.json").read_text())["results"])
    ours = json.loads((exp / "summary.json").read_text())
    want = json.loads((ref / "summary.json").read_text())
    assert ours["seeds"] == [0] and all(r["n"] == 1 for r in ours["rows"])
    for key in ("rows", "second_best", "classifiers"):
        assert json.dumps(ours[key]) == json.dumps(want[key]), key

    def no_time(md):  # the run-time column differs between runs
        return [line.rsplit("|", 2)[0] for line in md.splitlines()]

    assert no_time((exp / "summary.md").read_text()) == no_time((ref / "summary.md").read_text())


def test_dry_run_lists_the_job_graph_and_its_gpu_hours(pipeline_run, tmp_path, capsys):
    """Issue 32 item 4: 2 seeds x 2 rows; seed 0's stages are done (copied from pipeline_run)
    and left out; seed 1's jobs wait for what they start from; GPU hours = iterations x
    --sec-per-iter / 3600 (3 iterations per stage here)."""
    import shutil

    from braixdet.pipeline import experiments

    exp = tmp_path / "exp"
    shutil.copytree(pipeline_run["out"], exp / "s0", symlinks=True)
    argv = pipeline_argv(pipeline_run["root"], exp, ("faster_rcnn", "braixdet"))
    out = experiments.run(experiments.parse_args([
        *argv, "--seeds", "0", "1", "--dry-run", "--gpus-per-job", "8",
        "--sec-per-iter", "stage1=1200", "detector=2400"]))
    graph = {j.key: (j.after, j.gpus, j.iterations) for j in out["jobs"]}
    assert graph == {
        "s1/mvccl": ((), 8, 3), "s1/classifier_single_view": ((), 8, 3),
        "s1/gradcam": (("s1/mvccl",), 1, None),
        "s1/faster_rcnn": (("s1/classifier_single_view",), 8, 3),
        "s1/braixdet": (("s1/mvccl", "s1/gradcam"), 8, 3),
        "summary": (("s1/mvccl", "s1/classifier_single_view", "s1/gradcam", "s1/faster_rcnn",
                     "s1/braixdet"), 0, None)}
    # 2 classifiers x 3 x 1200 s + 2 detectors x 3 x 2400 s = 6 GPU hours
    assert "6 jobs; training GPU hours: 6.0" in capsys.readouterr().out
    assert not (exp / "submitit").exists()  # nothing submitted


def test_stage_log_is_written_line_by_line_and_algorithm2_reaches_progress(tmp_path, capsys):
    """run_stage writes a stage's full log as each line comes (a person tailing a long stage
    saw nothing for 8 KB, about 15 minutes of training), and the trainer's Algorithm 2 line is
    a progress line again (its wording changed from 'GradCAM fusion')."""
    from braixdet.pipeline.stages import run_stage

    log = tmp_path / "logs" / "stage.log"
    line = "[11/27 05:00:00 braixdet.engine.trainers]: Algorithm 2: oracle boxes fused during " \
           "the first 5 iterations"
    # the stage waits (up to 30 s) until its first line is in the log, then says what it saw
    child = (f"import time\nprint({line!r}, flush=True)\nend = time.time() + 30\n"
             f"def seen():\n    return 'Algorithm 2' in open({str(log)!r}).read()\n"
             "while not seen() and time.time() < end:\n    time.sleep(0.05)\n"
             "print('seen' if seen() else 'not seen', flush=True)\n")
    run_stage("probe", [sys.executable, "-c", child], str(log))
    assert log.read_text().splitlines() == [line, "seen"]
    assert "\n   Algorithm 2: oracle boxes fused during the first 5 iterations\n" in \
        capsys.readouterr().out


def test_stage_cpu_seconds_are_its_own_beside_another_child(tmp_path):
    """run_stage returns the CPU time of its own process (wait4), not the caller's
    RUSAGE_CHILDREN, which also counts another child that ended meanwhile: a ceiling trained
    from a thread beside local jobs (launcher.run_parallel) recorded their CPU as its own."""
    import subprocess
    import threading

    from braixdet.pipeline.stages import run_stage

    burn = "import time\nend = time.process_time() + 1.5\nwhile time.process_time() < end: pass"
    other = subprocess.Popen([sys.executable, "-c", burn])
    reaper = threading.Thread(target=other.wait)  # reaped while the stage runs
    reaper.start()
    own = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n" \
          "time.sleep(2.5)"
    cpu = run_stage("probe", [sys.executable, "-c", own], str(tmp_path / "probe.log"))
    reaper.join()
    assert other.returncode == 0
    assert 0.3 <= cpu < 1.3  # its own 0.3 s and start-up, not the other child's 1.5 s


def test_a_cluster_job_runs_its_stage_only_from_the_stages_it_waits_for(monkeypatch, tmp_path):
    """Issue 32: a detector job needs only Plan.after's stages done (the seed's other
    classifier may still be running); a job whose input stage is not done stops with one line
    instead of training that stage itself; the summary job trains nothing."""
    import argparse

    from braixdet.pipeline.core import Pipeline, Plan
    from braixdet.pipeline.stages import StageFailed, mark_done

    args = argparse.Namespace(
        dataset="cbis_ddsm", root=str(tmp_path), csv="", protocol="partial", ratio="1/8",
        seed=0, out=str(tmp_path / "o"), configs="demo", methods=["faster_rcnn", "braixdet"],
        num_gpus=1, num_machines=1, machine_rank=0, dist_url="auto", opts=[], stage1_opts=[],
        det_opts=[])
    plan = Plan(stage1=("mvccl", "classifier_single_view"), gradcam=True, cam_only=False,
                detectors=("faster_rcnn", "braixdet"), no_weak=False)
    assert plan.after("braixdet") == ("mvccl", "gradcam")
    assert plan.after("faster_rcnn") == ("classifier_single_view",)
    for done in ("mvccl", "gradcam"):  # classifier_single_view: still running
        mark_done(str(tmp_path / "o" / done))
    trained = []
    monkeypatch.setattr("braixdet.pipeline.core.read_metrics", lambda folder: {})
    for job in ("braixdet", "faster_rcnn", "summary"):
        pipe = Pipeline(args, job=job)
        monkeypatch.setattr(pipe, "run", lambda name, cmd: trained.append(
            (name, cmd[cmd.index("MODEL.BRAIXDET.INIT_FROM_CLASSIFIER") + 1])))
        if job == "braixdet":
            pipe.run_job(job, plan)
        else:
            with pytest.raises(StageFailed, match="stage classifier_single_view of .* not done"):
                pipe.run_job(job, plan) if job != "summary" else pipe.run_all()
    assert trained == [("braixdet", str(tmp_path / "o" / "mvccl" / "model_final.pth"))]


def test_full_protocol_counts_d_w_from_the_split_a_run_wrote(synthetic_root, tmp_path,
                                                              monkeypatch):
    """Issue 30: under --protocol full the parent pipeline asks whether D_w holds an image. It
    loads the dataset only while no run has written the split (the stage-1 run writes it to
    <out>/splits); after that it counts D_w in the split file, reading no image."""
    import argparse

    from braixdet.data import register
    from braixdet.pipeline import Pipeline, add_pipeline_arguments

    loads = []
    load = register._load_all
    monkeypatch.setattr(register, "_load_all", lambda spec: loads.append(spec) or load(spec))
    args = add_pipeline_arguments(argparse.ArgumentParser()).parse_args([
        "--root", synthetic_root.root, "--protocol", "full", "--out", str(tmp_path / "out"),
        "--configs", os.path.join(REPO, "configs", "demo"),
        "--opts", "DATASETS.BRAIXDET.NAME", "dw_count"])
    assert Pipeline(args).has_weak_images() is False  # CBIS layout: every image has boxes
    assert len(loads) == 1 and os.path.isfile(loads[0].split_file)
    assert Pipeline(args).has_weak_images() is False
    assert len(loads) == 1  # counted in the split file
