"""Every benchmark the README shows runs through its main() (tiny sizes: smoke, not timing).
The measured ratios come from `make bench` on the benchmark machine, never from here."""
import os
import sys

import pytest
import torch
from _train_helpers import FEW_PROPOSALS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--size", "128", "64"]
CASES = {
    "benchmark_preprocess": ["--quick", "--num", "1", "--orig", "300", "200", "--size", "64", "32",
                             "--warm-repeats", "1"],
    "benchmark_dataloader": [*TINY, "--patients", "3", "--orig", "128", "96", "--batch", "2",
                             "--rounds", "1", "--block", "1", "--settle", "0", "--warmup", "0"],
    "benchmark_gradcam": [*TINY, "--batch", "1", "--repeats", "1", "--warmup", "0"],
    "benchmark_ssl_iteration": [*TINY, "--batch", "1", "--repeats", "1", "--warmup", "0",
                                "--amp", "--profile", "--profile-steps", "1", "--cam"],
    "benchmark_stage1_step": [*TINY, "--batch", "2", "--repeats", "1", "--warmup", "0",
                              "--grad-checkpointing"],
    "benchmark_exam_inference": [*TINY, "--repeats", "1", "--warmup", "0", "--compare-amp"],
    "benchmark_evaluator": ["--images", "40", "--dets", "10", "--repeat", "1"],
}
# bf16 kernels on a CPU are slow: the tiny detectors' proposal budget keeps these smoke runs
# short (every code path still runs)
OPTS = {"benchmark_ssl_iteration": FEW_PROPOSALS, "benchmark_exam_inference": FEW_PROPOSALS}


@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_runs_through_main(name, monkeypatch, tmp_path, capsys, load_tool):
    monkeypatch.setenv("BENCH_THREADS", "1")
    out = tmp_path / "report.md"
    args = [*CASES[name]] + ([] if name == "benchmark_evaluator" else ["--device", "cpu"])
    if name not in ("benchmark_preprocess", "benchmark_evaluator"):
        args += ["--out", str(out)]
    if name in OPTS:  # --opts takes the rest of the line
        args += ["--opts", *OPTS[name]]
    monkeypatch.setattr(sys, "argv", [name + ".py", *args])
    load_tool(name, folder="benchmarks").main()
    text = capsys.readouterr().out
    assert "|" in text  # printed a table
    if name not in ("benchmark_preprocess", "benchmark_evaluator"):
        assert out.read_text().strip()


@pytest.mark.parametrize("name", ["experiment_ratio_grid", "experiment_pseudo_threshold"])
def test_experiment_scripts_import_and_parse(name, capsys, load_tool):
    """The development-set experiments (hours of CPU, never run here) import and parse their
    arguments through main(): a renamed package name they use fails here, not on the next run."""
    module = load_tool(name, folder="benchmarks")
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0 and "--data-seed" in capsys.readouterr().out


def test_stage1_dev_criterion_at_its_edges(capsys, load_tool):
    """RESULTS §11: stage 1 learns when its export's validation BCE is below chance (ln 2) and
    its test AUC is at least 0.75; the script parses its arguments through main()."""
    import math

    script = load_tool("experiment_stage1_dev", folder="benchmarks")
    learns, main = script.learns, script.main

    def export(val_bce, test_auc):
        return {"val": {"BCE": val_bce}, "test": {"AUC": test_auc}}

    assert learns(export(0.69, 0.75))
    assert not learns(export(math.log(2), 0.9))  # at chance: not below it
    assert not learns(export(0.5, 0.749))
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "--candidates" in capsys.readouterr().out
    # the draw: set D by default (RESULTS §11), its size with --patients, or --set's (§34)
    import argparse

    def draw(**kw):
        return script.draw_settings(argparse.Namespace(**{"set": None, "patients": None, **kw}))

    assert draw() == {"patients": 300, "seed": 2727}
    assert draw(patients=1300) == {"patients": 1300, "seed": 2727}
    assert draw(set=["patients=1300"]) == {"patients": 1300}
    with pytest.raises(SystemExit):
        main(["--out", "unused", "--set", "patients=1300", "--patients", "1300"])
    assert "with --set, give patients=N there" in capsys.readouterr().err


def test_benchmark_regime_criteria_and_settings(tmp_path, load_tool):
    """The criteria of docs/RESULTS.md §10 at their edges, and --set refused for unknown keys
    (the experiment itself is hours of CPU: not run here)."""
    script = load_tool("experiment_benchmark_regime", folder="benchmarks")
    check, make_regime, parse_sets = script.check, script.make_regime, script.parse_sets

    assert check(45.0, 60.0)["all_met"]  # gap exactly 15
    assert not check(45.0, 59.9)["all_met"]
    assert not check(60.1, 80.0)["all_met"] and not check(34.9, 70.0)["all_met"]
    assert not check(60.0, 85.1)["all_met"] and check(60.0, 85.0)["all_met"]
    assert parse_sets(["patients=8", "image_size=(96, 64)"]) == {"patients": 8,
                                                                  "image_size": (96, 64)}
    with pytest.raises(SystemExit, match="not a make_synthetic_dataset setting: contrast"):
        make_regime("benchmark_a", {"contrast": 0.5}, str(tmp_path))
    assert not os.listdir(tmp_path)  # refused before writing anything
    # a re-run with a tuple override finds its own data (the marker stores lists)
    sets = parse_sets(["patients=2", "image_size=(96, 64)"])
    root, record = make_regime("benchmark_a", sets, str(tmp_path))
    assert make_regime("benchmark_a", sets, str(tmp_path)) == (root, record)
    with pytest.raises(SystemExit, match="holds another regime's data"):
        make_regime("benchmark_a", dict(sets, patients=3), str(tmp_path))

    # several 1/8 schedules: the criteria use the export that validates best (RESULTS §18)
    assert script.pick_floor({3.0: {"val_ap20": 40.0}, 6.0: {"val_ap20": 39.9}}) == 3.0
    assert script.pick_floor({3.0: {"val_ap20": 40.0}, 6.0: {"val_ap20": 40.0}}) == 6.0
    assert script.pick_floor({3.0: {"val_ap20": None}, 6.0: {"val_ap20": 1.0}}) == 6.0
    stage = tmp_path / "faster_rcnn"
    stage.mkdir()
    torch.save({"model": {}, "selected": {"iteration": 7, "metric": "m", "value": 41.5}},
               stage / "model_export.pth")
    assert script.export_selection(str(stage)) == (7, 41.5)


def test_benchmark_regime_runs_started_together_generate_once(tmp_path, load_tool,
                                                               monkeypatch):
    """Seeds of one --out started in two shells at once: one generates the regime, the other
    waits for it and finds the same data (before the lock both wrote into one folder)."""
    import threading

    import synthetic_mammo

    make_regime = load_tool("experiment_benchmark_regime", folder="benchmarks").make_regime
    generate, calls = synthetic_mammo.make_synthetic_dataset, []
    start = threading.Barrier(2)

    def counted(*args, **kwargs):
        calls.append(1)
        return generate(*args, **kwargs)

    monkeypatch.setattr(synthetic_mammo, "make_synthetic_dataset", counted)
    sets = {"patients": 2, "image_size": (96, 64)}
    results = []

    def run():
        start.wait()
        results.append(make_regime("benchmark_a", sets, str(tmp_path)))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]
    assert os.path.exists(os.path.join(results[0][0], "exams.csv"))


def test_box_sources_quality_by_phase(load_tool, tmp_path, capsys):
    """experiment_box_sources.py (issue 27 items 3 and 5; hours of CPU, not run here): the
    quality means split at the fusion phase the trainer logged; main() parses its arguments."""
    script = load_tool("experiment_box_sources", folder="benchmarks")
    curves = {"fused": {"precision": [(19, 0.5), (39, 1.0), (59, 0.0)], "recall": [(19, 0.2)]}}
    assert script.mean_quality(curves, 0, 39) == {"fused_precision": 0.75, "fused_recall": 0.2}
    assert script.mean_quality(curves, 40, 59) == {"fused_precision": 0.0}
    (tmp_path / "log.txt").write_text(
        "[11/25 18:00:00 braixdet.engine.trainers]: Algorithm 2: GradCAM fusion during the "
        "first 40 iterations\n")
    assert script._fusion_end(str(tmp_path)) == 39  # a log written before 2026-11-27
    (tmp_path / "log.txt").write_text(
        "[11/27 05:00:00 braixdet.engine.trainers]: Algorithm 2: oracle boxes fused during the "
        "first 41 iterations\n")
    assert script._fusion_end(str(tmp_path)) == 40
    with pytest.raises(SystemExit) as e:
        script.main(["--help"])
    assert e.value.code == 0 and "--stage1" in capsys.readouterr().out


def test_fusion_bounds_verdict_follows_the_written_criteria(capsys, load_tool, tmp_path):
    """experiment_fusion_bounds.py (RESULTS §16; CPU hours, not run here): the five rows' effects
    paired by seed, the verdict of the criteria written before the runs in their order and at
    their edges, main() parses its arguments."""
    from braixdet.pipeline.methods import METHODS
    from braixdet.pipeline.results import paired_effect

    script = load_tool("experiment_fusion_bounds", folder="benchmarks")
    grid = {"mean_teacher": [70, 60, 65], "braixdet": [71, 62, 65],
            "braixdet_random_boxes": [69, 61, 66], "braixdet_oracle_boxes": [72, 59, 66],
            "braixdet_oracle_boxes_whole_schedule": [80, 75, 77]}
    per_seed = [{"results": {METHODS[k].label: {"bbox": {"AP20": v[i]}} for k, v in grid.items()}}
                for i in range(3)]
    effects = script.effects_of(per_seed, script.effects_between(script.DEFAULT_ROWS),
                                script.DEFAULT_ROWS)
    assert script.GRADCAM_WHOLE not in effects  # its row is not among the default rows
    want = paired_effect(grid["braixdet_oracle_boxes_whole_schedule"], grid["mean_teacher"])
    assert {k: effects[script.ORACLE_WHOLE][k] for k in want} == want
    assert effects["GradCAM − random boxes"]["mean"] == pytest.approx(2 / 3)
    assert script.verdict(effects).startswith("the loss is in Algorithm 2's window")
    from braixdet.pipeline.results import seeds_to_detect

    sd = effects[script.FUSION]["sd"]  # BRAIxDet − Mean Teacher: 1, 2, 0
    assert script.seeds_for_paper(effects).endswith(
        f"(sd {sd:.1f} AP over 3 seeds): {seeds_to_detect(92.78 - 90.51, sd)}.")
    assert script.seeds_for_paper({}) is None

    def with_lows(fusion, oracle, whole, n=5):
        return {script.FUSION: {"ci_low": fusion, "n": n}, script.ORACLE: {"ci_low": oracle},
                script.ORACLE_WHOLE: {"ci_low": whole}}

    cases = [((0.01, 5, 5), "BRAIxDet ahead"), ((0.0, 0.01, 5), "the loss is in Algorithm 1"),
             ((-1, 0.0, 0.01), "the loss is in Algorithm 2's window"),
             ((-1, -1, 0.0), "the fusion adds nothing measurable")]
    for lows, answer in cases:
        assert script.verdict(with_lows(*lows)).startswith(answer), lows
    assert script.verdict(with_lows(5, 5, 5, n=1)).startswith("undecided")
    missing = with_lows(5, 5, 5)
    del missing[script.ORACLE]  # --rows without the paper's-window oracle: no verdict
    assert script.verdict(missing).startswith("undecided: not every row")
    # each row against the ceiling, paired by seed over the seeds where both ran
    from braixdet.pipeline.results import CEILING

    for i, value in enumerate([72, 66, 70]):
        if i < 2:  # the third seed has no ceiling
            per_seed[i]["results"][CEILING] = {"bbox": {"AP20": value}}
    context = script.ceiling_effects(per_seed, ["mean_teacher", "braixdet"])
    mt = context[f"{METHODS['mean_teacher'].label} − ceiling"]
    assert mt["n"] == 2 and mt["mean"] == pytest.approx(-4.0)
    assert mt["rows"] == [["mean_teacher"], [CEILING]]
    assert script.effects_table(context)[2].startswith(
        f"| {METHODS['mean_teacher'].label} − ceiling | {METHODS['mean_teacher'].label} − "
        f"{CEILING} | 2 | -4.0 ")
    import cv2

    png = script.plot_rows(per_seed, [0, 1, 2], str(tmp_path / "rows.png"), script.DEFAULT_ROWS)
    assert cv2.imread(png).shape == (456, 1020, 3)  # 8.5 x 3.8 inches at 120 dpi
    # the new row fuses true boxes past any schedule; the paper's window stays on the others
    from braixdet.config import build_cfg
    from braixdet.ssl.pseudo_labels import fusion_iters_from_cfg

    for key, whole, source in (("braixdet_oracle_boxes_whole_schedule", True, "oracle"),
                               ("braixdet_oracle_boxes", False, "oracle"),
                               ("braixdet_whole_schedule", True, "gradcam"),
                               ("braixdet", False, "gradcam")):
        m = METHODS[key]
        cfg = build_cfg(os.path.join(REPO, "configs", "demo", m.config), list(m.opts))
        iters = fusion_iters_from_cfg(10_000, cfg.DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH,
                                      cfg.SSL.CAM_FUSION_EPOCHS, cfg.SSL.CAM_FUSION_ITERS)
        assert (iters > 10 ** 8) == whole and cfg.SSL.CAM_BOX_SOURCE == source, key
        assert m.cam == (source == "gradcam"), key  # only GradCAM's rows read Algorithm 1's JSON
    with pytest.raises(SystemExit) as e:
        script.main(["--help"])
    usage = capsys.readouterr().out
    assert e.value.code == 0 and "--seeds" in usage and "--ratio" in usage
    # Mean Teacher's pseudo-box quality is split at BRAIxDet's fusion phase of the same seed
    import json

    for key, values in (("braixdet", (0.2, 0.6)), ("mean_teacher", (0.1, 0.5))):
        stage = tmp_path / "q" / "s0" / key
        stage.mkdir(parents=True)
        (stage / "metrics.json").write_text("\n".join(
            json.dumps({"iteration": it, "ssl/quality/teacher_precision": v})
            for it, v in ((9, values[0]), (19, values[1]), (29, values[1]))))
    (tmp_path / "q" / "s0" / "braixdet" / "log.txt").write_text(
        "[11/26 10:00:00 braixdet.engine.trainers]: Algorithm 2: GradCAM fusion during the "
        "first 10 iterations\n")
    quality = script.pseudo_quality(str(tmp_path / "q"), [0, 1], ["mean_teacher", "braixdet"])
    assert quality["mean_teacher"][0]["fusion_end"] == quality["braixdet"][0]["fusion_end"] == 9
    assert quality["mean_teacher"][0]["fusion_phase"] == {"teacher_precision": 0.1}
    assert quality["mean_teacher"][0]["after"] == {"teacher_precision": 0.5}
    assert set(quality["braixdet"]) == {0}  # seed 1 ran nothing
    with pytest.raises(SystemExit) as e:  # --rows takes the script's rows only
        script.main(["--out", str(tmp_path), "--rows", "faster_rcnn"])
    assert e.value.code == 2 and "invalid choice: 'faster_rcnn'" in capsys.readouterr().err


def test_demo_data_criteria_and_candidates(capsys, load_tool):
    """RESULTS §1.8 (the demo's data; CPU hours, not run here): the criteria at their edges,
    every candidate a make_synthetic_dataset setting, main() parses its arguments."""
    import inspect

    from synthetic_mammo import make_synthetic_dataset

    script = load_tool("experiment_demo_data", folder="benchmarks")

    def qualifies(auc, floor, ceiling):
        return script.verdict({"mvccl_test_auc": auc, "floor_ap20": floor,
                               "ceiling_ap20": ceiling})[1]

    assert qualifies(0.75, 70.0, 80.0) and qualifies(0.9, 80.0, 90.0)  # edges pass
    assert not qualifies(0.749, 70.0, 85.0)  # stage 1 does not learn
    assert not qualifies(0.9, 75.1, 85.0)  # gap under 10
    assert not qualifies(0.9, 70.0, 90.1)  # ceiling above 90
    known = set(inspect.signature(make_synthetic_dataset).parameters)
    assert all(set(c) <= known for c in script.CANDIDATES.values())
    with pytest.raises(SystemExit) as e:
        script.main(["--help"])
    assert e.value.code == 0 and "--candidates" in capsys.readouterr().out


def test_table6_experiment_parses_and_refuses_an_unknown_setting(tmp_path, capsys, load_tool):
    """experiment_table6.py (issue 27 item 2; hours of CPU, not run here) parses through main()
    and refuses a generator key it does not know before writing anything."""
    script = load_tool("experiment_table6", folder="benchmarks")
    with pytest.raises(SystemExit) as e:
        script.main(["--help"])
    assert e.value.code == 0 and "--ceiling-epochs" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not a make_synthetic_dataset setting: contrast"):
        script.main(["--regime", "benchmark_a", "--set", "contrast=0.5", "--out", str(tmp_path)])
    assert not os.listdir(tmp_path)


def test_table6_parallel_runs_the_ceiling_beside_the_rows_and_leaves_a_complete_run(
        tmp_path, capsys, load_tool):
    """experiment_table6.py --parallel (one large GPU): the grid's stages as local submitit
    jobs and the ceiling from the copied classifier as soon as that is done, while the rows still
    train; the serial path then finds every stage done, trains nothing, and writes the same
    rows."""
    import json
    import shutil

    script = load_tool("experiment_table6", folder="benchmarks")
    argv = ["--regime", "benchmark_a", "--set", "patients=24", "image_size=(256,128)", "--out",
            str(tmp_path), "--seeds", "0", "--size", "64", "32", "--stage1-epochs", "1.0",
            "--det-epochs", "0.5", "--ceiling-epochs", "0.5", "--methods", "faster_rcnn",
            "--opts", "DATASETS.BRAIXDET.ALLOW_LESION_FREE_VAL", "True"]
    script.main([*argv, "--parallel"])
    assert "local job" in capsys.readouterr().out
    run = tmp_path / "r1_8" / "s0"
    stages = sorted(run.glob("**/stage_done.json"))
    markers = {p: p.read_bytes() for p in stages}
    assert {str(p.relative_to(run).parent) for p in stages} >= {
        "classifier_single_view", "faster_rcnn", "ceiling/classifier_single_view",
        "ceiling/faster_rcnn"}
    assert (run / "ceiling/classifier_single_view/stage_done.json").read_bytes() == \
        (run / "classifier_single_view/stage_done.json").read_bytes()  # copied, not trained
    row = json.loads((run / "faster_rcnn/stage_done.json").read_text())
    ceiling = json.loads((run / "ceiling/faster_rcnn/stage_done.json").read_text())
    assert ceiling["finished"] - ceiling["seconds"] < row["finished"]  # beside, not after
    parallel = json.loads((tmp_path / "table6.json").read_text())["rows"]
    assert [r["method"] for r in parallel["rows"]] == [
        "Faster R-CNN", "Faster R-CNN, full labels (ceiling)"]
    # the regime's criteria on the two rows (experiment_benchmark_regime's check)
    regime = load_tool("experiment_benchmark_regime", folder="benchmarks")
    table = json.loads((tmp_path / "table6.json").read_text())
    floor, ceiling = (json.loads((run / d / "inference/model/cbis_ddsm_test/metrics.json")
                                 .read_text())["bbox"]["AP20"]
                      for d in ("faster_rcnn", "ceiling/faster_rcnn"))
    assert table["criteria"] == regime.check(floor, ceiling)
    assert "Regime criteria" in (tmp_path / "table6.md").read_text()
    script.main(argv)
    assert {p: p.read_bytes() for p in sorted(run.glob("**/stage_done.json"))} == markers
    serial = json.loads((tmp_path / "table6.json").read_text())["rows"]
    assert json.dumps(serial) == json.dumps(parallel)  # as text: one seed's std is NaN
    # --no-ceiling: the rows alone, from the done stages, without the ceiling's row or criteria
    shutil.rmtree(run / "ceiling")
    script.main([*argv, "--no-ceiling", "--parallel"])
    rows_only = json.loads((tmp_path / "table6.json").read_text())
    assert not (run / "ceiling").exists() and rows_only["criteria"] is None
    assert json.dumps(rows_only["rows"]["rows"]) == json.dumps(parallel["rows"][:1])
    with pytest.raises(SystemExit):
        script.main([*argv, "--ceiling-epochs", "0"])
    assert "--no-ceiling leaves the ceiling out" in capsys.readouterr().err
    # --record: the done rows go to the record, which a run of other settings refuses untouched
    record = tmp_path / "record.json"
    script.main([*argv, "--no-ceiling", "--record", str(record), "--opts", "NUM_THREADS", "1"])
    kept = record.read_bytes()
    entry = json.loads(kept)["seeds"]["0"]
    import cv2  # the record's picture beside it: the one row, drawn as the run's own

    assert cv2.imread(str(tmp_path / "record.png")).shape == (456, 1020, 3)
    assert (tmp_path / "record.png").read_bytes() == (tmp_path / "table6.png").read_bytes()
    assert entry["results"] == rows_only["per_seed"][0]
    assert entry["runs"]["Faster R-CNN"]["machine"].endswith(f"({os.cpu_count()} cores)")
    assert entry["runs"]["Faster R-CNN"]["opts"][-2:] == ["NUM_THREADS", "1"]
    assert entry["runs"]["Faster R-CNN"]["stage1"] == {
        "classifier": "classifier_single_view",
        "test_AUC": entry["classifiers"]["classifier_single_view"]["test"]["AUC"]}
    with pytest.raises(SystemExit, match="records rows of other settings"):
        script.main([*argv, "--det-epochs", "1.0", "--record", str(record)])
    assert record.read_bytes() == kept


def test_table6_record_pairs_rows_from_separate_runs_by_seed(tmp_path, capsys, load_tool):
    """experiment_table6.py --record: rows trained in separate runs (fresh machines, GPU leases)
    are paired by seed in the tables; a row recorded once keeps its value."""
    from braixdet.pipeline.results import OURS, paired_tables

    script = load_tool("experiment_table6", folder="benchmarks")
    path, settings = str(tmp_path / "record.json"), {"regime": "r", "size": [256, 128]}

    def summary(seed, **rows):
        return {"results": {k: {"bbox": {"AP20": v, "R@0.5": v}} for k, v in rows.items()},
                "protocol": {"seed": seed}, "row_cpu_seconds": {k: 60.0 for k in rows}}

    mt = "MV + SSL (Mean Teacher)"
    a = {"machine": "cpu A", "opts": [], "recorded": "d"}
    b = dict(a, machine="gpu B")
    script.update_record(path, settings, [1, 0], [summary(1, **{mt: 50.0}),
                                                   summary(0, **{mt: 60.0})], a)
    per_seed = script.update_record(path, settings, [0, 1, 2], [
        summary(0, **{OURS: 64.0, mt: 61.0}), summary(1, **{OURS: 53.0}),
        summary(2, **{OURS: 40.0, mt: 38.0})], b)
    assert "seed 0 MV + SSL (Mean Teacher): recorded AP@0.2 60.00 (cpu A), this run 61.00 " \
        "(gpu B); the recorded row is kept" in capsys.readouterr().out
    assert [s["protocol"]["seed"] for s in per_seed] == [0, 1, 2]
    assert [s["runs"][mt]["machine"] for s in per_seed] == ["cpu A", "cpu A", "gpu B"]
    _, tables = paired_tables(per_seed)
    assert tables["ours_vs"][mt]["n"] == 3
    assert tables["ours_vs"][mt]["mean"] == pytest.approx((4 + 3 + 2) / 3)
    with pytest.raises(SystemExit, match="other settings"):
        script.update_record(path, dict(settings, size=[512, 256]), [], [], b)


def test_table6_record_update_waits_for_another_run_ending_at_once(tmp_path, load_tool):
    """Two runs of one record ending together (a seed's rows trained side by side) must not
    lose either's rows: an update waits while another holds the record's lock."""
    import json
    import threading

    from filelock import FileLock

    script = load_tool("experiment_table6", folder="benchmarks")
    path, settings = str(tmp_path / "record.json"), {"regime": "r"}
    run = {"machine": "m", "opts": [], "recorded": "d"}

    def summary(seed, row):
        return {"results": {row: {"bbox": {"AP20": 50.0, "R@0.5": 60.0}}},
                "protocol": {"seed": seed}, "row_cpu_seconds": {row: 1.0}}

    script.update_record(path, settings, [2], [summary(2, "STAC")], run)
    with FileLock(path + ".lock"):  # the other run, between reading and writing the record
        late = threading.Thread(target=script.update_record,
                                args=(path, settings, [2], [summary(2, "BRAIxDet")], run))
        late.start()
        late.join(0.5)
        assert late.is_alive()
        with open(path) as f:
            assert set(json.load(f)["seeds"]["2"]["results"]) == {"STAC"}
        script._update_record(path, settings, [0], [summary(0, "Faster R-CNN")], run)
    late.join(10)
    with open(path) as f:
        seeds = json.load(f)["seeds"]
    assert set(seeds) == {"0", "2"} and set(seeds["2"]["results"]) == {"STAC", "BRAIxDet"}


def table6_args(tmp_path):
    """experiment_table6.py's parsed arguments at the first regime's schedule (det-epochs 6)."""
    import argparse

    return argparse.Namespace(ratio="1/8", size=[256, 128], stage1_epochs=5.0, det_epochs=6.0,
                              ceiling_epochs=8.0, opts=[], stage1_opts=[], det_opts=[],
                              root=str(tmp_path), out=str(tmp_path), methods=["braixdet"],
                              run_dir=str(tmp_path / "r1_8"))


def test_table6_detectors_fuse_for_the_papers_share_and_the_record_keeps_the_window(
        tmp_path, load_tool):
    """experiment_table6.py at --det-epochs 6: the detectors get Algorithm 2's window at the
    paper's 2 of 20 epochs (0.6, not the demo config's 0.3), and a record holds the window in
    its settings, so rows of another window are refused, not paired (RESULTS §22, 2026-12-01)."""
    import argparse

    script = load_tool("experiment_table6", folder="benchmarks")
    a = table6_args(tmp_path)
    det_opts = script.pipeline_args(a).det_opts
    assert dict(zip(det_opts[::2], det_opts[1::2]))["SSL.CAM_FUSION_EPOCHS"] == "0.6"
    settings = script.record_settings(a, {"regime": "r"})
    assert settings["cam_fusion_epochs"] == 0.6
    # how often a run is checkpointed changes no weight: its rows belong to the same record
    banked = argparse.Namespace(**dict(vars(a), opts=["SOLVER.CHECKPOINT_PERIOD", "100"]))
    assert script.record_settings(banked, {"regime": "r"}) == settings
    threaded = argparse.Namespace(**dict(vars(a), stage1_opts=["NUM_THREADS", "2"],
                                         det_opts=["DATALOADER.NUM_WORKERS", "1"]))
    assert script.record_settings(threaded, {"regime": "r"}) == settings
    path = str(tmp_path / "record.json")
    script.update_record(path, settings, [], [], {"machine": "m", "opts": [], "recorded": "d"})
    half = argparse.Namespace(**dict(vars(a), det_opts=["SSL.CAM_FUSION_EPOCHS", "0.3"]))
    assert script.record_settings(half, {"regime": "r"})["cam_fusion_epochs"] == 0.3
    with pytest.raises(SystemExit, match="other settings"):
        script.load_record(path, script.record_settings(half, {"regime": "r"}))


def test_demo_box_head_criterion_at_its_edges(capsys, load_tool, tmp_path):
    """RESULTS §1.11 (CPU minutes, not run here): a narrower head passes when the mean paired
    difference of every row is at least -3 AP@0.2, fails when one row's is below; a finished
    seed of other --fc-dims is refused, not tabled; main() parses its arguments."""
    import argparse
    import json

    script = load_tool("experiment_demo_box_head", folder="benchmarks")
    (tmp_path / "s0.json").write_text(json.dumps({"1024": {"floor": 80.0, "ceiling": 90.0},
                                                  "256": {"floor": 79.0, "ceiling": 90.0}}))
    a = argparse.Namespace(out=str(tmp_path), fc_dims=[1024, 256], threads=1)
    assert script.run_seed(a, 0, str(tmp_path))[256] == {"floor": 79.0, "ceiling": 90.0}
    with pytest.raises(SystemExit, match="holds FC_DIM"):
        script.run_seed(argparse.Namespace(**dict(vars(a), fc_dims=[1024, 512])), 0,
                        str(tmp_path))

    def seeds(floor_diffs, ceiling_diffs):
        return {s: {1024: {"floor": 80.0, "ceiling": 90.0},
                    256: {"floor": 80.0 + f, "ceiling": 90.0 + c}}
                for s, (f, c) in enumerate(zip(floor_diffs, ceiling_diffs))}

    text, verdicts = script.table(seeds([-4.0, -2.0], [0.0, 0.0]), [1024, 256])
    assert verdicts == {("floor", 256): True, ("ceiling", 256): True}
    assert "-3.0 (-4.0, -2.0)" in text and "FC_DIM 256: met" in text
    text, verdicts = script.table(seeds([0.0, 0.0], [-3.2, -3.0]), [1024, 256])
    assert verdicts == {("floor", 256): True, ("ceiling", 256): False}
    assert "FC_DIM 256: not met" in text
    with pytest.raises(SystemExit) as e:
        script.main(["--help"])
    assert e.value.code == 0 and "--fc-dims" in capsys.readouterr().out


def test_benchmark_regimes_keep_the_papers_box_head_where_the_demo_narrows_it(tmp_path,
                                                                            load_tool):
    """The demo's configs narrow the box head's fully connected layers to 256 (RESULTS §1.11);
    the benchmark scripts' detectors keep the paper's (torchvision's) 1024 that their records
    trained, and a --det-opts value still wins. Read from the box head detectron2 builds."""
    from detectron2.layers import ShapeSpec
    from detectron2.modeling.roi_heads import build_box_head

    from braixdet.config import build_cfg
    from braixdet.model_zoo import get_config_file

    def fc_widths(opts):
        cfg = build_cfg(get_config_file("demo/BRAIxDet/braixdet.yaml"), list(opts))
        head = build_box_head(cfg, ShapeSpec(channels=cfg.MODEL.FPN.OUT_CHANNELS, height=7,
                                             width=7))
        return [m.out_features for m in head.modules() if isinstance(m, torch.nn.Linear)]

    assert fc_widths([]) == [256, 256]
    script = load_tool("experiment_table6", folder="benchmarks")
    a = table6_args(tmp_path)
    assert fc_widths(script.pipeline_args(a).det_opts) == [1024, 1024]
    a.det_opts = ["MODEL.ROI_BOX_HEAD.FC_DIM", "512"]
    assert fc_widths(script.pipeline_args(a).det_opts) == [512, 512]


def test_table6_record_keeps_each_stage1_classifier_of_a_seed_split_across_runs(tmp_path,
                                                                                load_tool):
    """A seed's floor and its BRAIxDet row train different stage-1 classifiers in separate runs:
    the record keeps both (the first value of each), and the stage-1 table says how many seeds
    each mean is over, with no spread for one; each row's run names the export it started from."""
    from braixdet.pipeline.methods import METHODS
    from braixdet.pipeline.results import paper_table

    script = load_tool("experiment_table6", folder="benchmarks")
    path, settings = str(tmp_path / "record.json"), {"regime": "r"}
    run = {"machine": "cpu", "opts": [], "recorded": "d"}

    def summary(seed, row, **classifiers):
        return {"results": {row: {"bbox": {"AP20": 50.0, "R@0.5": 60.0}}},
                "protocol": {"seed": seed}, "row_cpu_seconds": {row: 1.0},
                "classifiers": {n: {"val": {"AUC": v}, "test": {"AUC": v - 0.05}}
                                for n, v in classifiers.items()}}

    script.update_record(path, settings, [0, 1], [
        summary(0, "Faster R-CNN", classifier_single_view=0.70),
        summary(1, "Faster R-CNN", classifier_single_view=0.60)], run)
    per_seed = script.update_record(path, settings, [0], [
        summary(0, "BRAIxDet", mvccl=0.80, classifier_single_view=0.99)], run)
    assert per_seed[0]["classifiers"] == {
        "classifier_single_view": {"val": {"AUC": 0.70}, "test": {"AUC": pytest.approx(0.65)}},
        "mvccl": {"val": {"AUC": 0.80}, "test": {"AUC": pytest.approx(0.75)}}}
    md, _ = paper_table(per_seed)
    assert "| classifier_single_view | 0.650 ± 0.071 | 0.600 ± 0.071 | 2 |" in md
    assert "| mvccl | 0.800 | 0.750 | 1 |" in md
    # each row names the export it started from, which the seed's first one need not be
    runs = per_seed[0]["runs"]
    assert runs["BRAIxDet"]["stage1"] == {"classifier": "mvccl", "test_AUC": pytest.approx(0.75)}
    assert runs["Faster R-CNN"]["stage1"] == {"classifier": "classifier_single_view",
                                              "test_AUC": pytest.approx(0.65)}
    ssl = METHODS["ssl_single_view"].label
    per_seed = script.update_record(path, settings, [0], [
        summary(0, ssl, classifier_single_view=0.80)], run)
    assert per_seed[0]["runs"][ssl]["stage1"]["test_AUC"] == pytest.approx(0.75)
    assert per_seed[0]["classifiers"]["classifier_single_view"]["test"]["AUC"] == \
        pytest.approx(0.65)


def test_against_record_pairs_a_candidate_with_the_records_rows_by_seed(tmp_path, capsys,
                                                                        load_tool):
    """experiment_against_record.py (RESULTS §33): each seed's test AP@0.2 read from the
    exported model's evaluation (not the training event log beside it), paired with the same
    seed's record rows (scipy's paired t as the reference); seeds or rows the record lacks are
    refused; NaN (one seed: no interval) is written as null."""
    import json

    import numpy as np
    from scipy import stats

    script = load_tool("experiment_against_record", folder="benchmarks")
    floor, mv, ours = [49.0, 52.0, 47.0], [48.0, 48.5, 46.0], [51.0, 49.5, 50.0]
    record = {"settings": {"ratio": "1/8"}, "seeds": {
        str(s): {"results": {"Faster R-CNN": {"bbox": {"AP20": floor[s]}},
                             "Faster R-CNN + MV": {"bbox": {"AP20": mv[s]}}}}
        for s in range(3)}}
    rec = tmp_path / "record.json"
    rec.write_text(json.dumps(record))
    runs = []
    for s in range(3):
        row = tmp_path / f"s{s}" / "row"
        test = row / "inference" / "model" / "cbis_ddsm_test"
        test.mkdir(parents=True)
        (row / "metrics.json").write_text('{"iteration": 19, "total_loss": 1.0}\n' * 2)
        (test / "metrics.json").write_text(json.dumps(
            {"bbox": {"AP20": ours[s], "R@0.5": 60.0 + s}, "breast_AUC": 75.0}))
        runs += ["--run", f"{s}={row}"]
    out = tmp_path / "pair.json"
    script.main(["--record", str(rec), *runs, "--against", "Faster R-CNN", "Faster R-CNN + MV",
                 "--name", "IA", "--out", str(out)])
    got = json.loads(out.read_text())
    assert [s["seed"] for s in got["seeds"]] == [0, 1, 2]  # every repeated --run kept
    assert got["seeds"][2]["IA"] == {"AP20": 50.0, "R@0.5": 62.0, "breast_AUC": 75.0}
    e = got["effects"]["IA − Faster R-CNN"]
    assert e["mean"] == pytest.approx(np.mean(np.subtract(ours, floor)))
    assert e["p_t"] == pytest.approx(stats.ttest_rel(ours, floor).pvalue)
    assert got["effects"]["IA − Faster R-CNN + MV"]["p_t"] == pytest.approx(
        stats.ttest_rel(ours, mv).pvalue)
    printed = capsys.readouterr().out  # rows: the candidate and each record row, by seed
    assert "| AP@0.2 | seed 0 | seed 1 | seed 2 | mean |" in printed
    assert "| IA | 51.0 | 49.5 | 50.0 | 50.2 |" in printed
    assert "| Faster R-CNN + MV | 48.0 | 48.5 | 46.0 | 47.5 |" in printed

    script.main(["--record", str(rec), "--run", f"1={tmp_path / 's1' / 'row'}", "--out",
                 str(out)])
    assert json.loads(out.read_text())["effects"]["candidate − Faster R-CNN"]["ci_low"] is None
    with pytest.raises(SystemExit, match="no seed 7"):
        script.main(["--record", str(rec), "--run", f"7={tmp_path / 's1' / 'row'}", "--out",
                     str(out)])
    with pytest.raises(SystemExit, match="no row 'STAC'"):
        script.main(["--record", str(rec), *runs, "--against", "STAC", "--out", str(out)])
    with pytest.raises(SystemExit, match="no test evaluation of its exported model"):
        script.main(["--record", str(rec), "--run", f"1={tmp_path / 's1'}", "--out", str(out)])
    with pytest.raises(SystemExit, match="expected SEED=FOLDER"):
        script.main(["--record", str(rec), "--run", "s1/row", "--out", str(out)])
    # a run's table6.json holds the same rows as a list over its seeds
    run_table = tmp_path / "table6.json"
    run_table.write_text(json.dumps({"seeds": [2, 0], "per_seed": [
        record["seeds"][str(s)]["results"] for s in (2, 0)]}))
    script.main(["--record", str(run_table), *runs[:2], *runs[4:], "--out", str(out)])
    assert json.loads(out.read_text())["effects"]["candidate − Faster R-CNN"]["mean"] == \
        pytest.approx((ours[0] - floor[0] + ours[2] - floor[2]) / 2)
    # floors retrained later, in two runs (seed 0; seeds 1-2), against the candidate's earlier
    # output (its training folders gone): the same pairing as from the folders
    later = [47.0, 50.5, 49.0]
    for part, seeds in (("a", [0]), ("b", [1, 2])):
        (tmp_path / f"later_{part}.json").write_text(json.dumps({"seeds": seeds, "per_seed": [
            {"Faster R-CNN": {"bbox": {"AP20": later[s]}}} for s in seeds]}))
    script.main(["--record", str(rec), *runs, "--name", "IA", "--out", str(out)])
    again = tmp_path / "again.json"
    script.main(["--record", str(tmp_path / "later_a.json"), str(tmp_path / "later_b.json"),
                 "--candidate", str(out), "--out", str(again)])
    got = json.loads(again.read_text())
    assert got["name"] == "IA" and got["seeds"][1]["IA"]["AP20"] == 49.5
    assert got["effects"]["IA − Faster R-CNN"]["p_t"] == pytest.approx(
        stats.ttest_rel(ours, later).pvalue)
    # a record row whose AP was undefined (written as null): that seed is shown as — and left
    # out of the pairing, not a traceback
    (tmp_path / "later_c.json").write_text(json.dumps({"seeds": [0, 1, 2], "per_seed": [
        {"Faster R-CNN": {"bbox": {"AP20": None if s == 1 else later[s]}}} for s in range(3)]}))
    script.main(["--record", str(tmp_path / "later_c.json"), "--candidate", str(out), "--out",
                 str(again)])
    got = json.loads(again.read_text())
    assert got["effects"]["IA − Faster R-CNN"]["n"] == 2
    assert got["effects"]["IA − Faster R-CNN"]["mean"] == pytest.approx(
        (ours[0] - later[0] + ours[2] - later[2]) / 2)
    assert "| Faster R-CNN | 47.0 | — | 49.0 | — |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="seed 0 is in both"):
        script.main(["--record", str(rec), str(tmp_path / "later_a.json"), "--candidate",
                     str(out), "--out", str(again)])
    with pytest.raises(SystemExit, match="not an output of experiment_against_record"):
        script.main(["--record", str(rec), "--candidate", str(rec), "--out", str(again)])
    for bad, why in [(tmp_path / "none.json", "No such file"), (out, "no 'seeds'")]:
        with pytest.raises(SystemExit, match=f"--record {bad}: .*{why}"):
            script.main(["--record", str(bad), *runs, "--out", str(tmp_path / "x.json")])


def test_mv_cost_effects_and_verdict_follow_the_written_criteria(capsys, load_tool):
    """experiment_mv_cost.py (RESULTS §15): effects paired by seed from the 2×2 grid's rows,
    and the verdict of the criteria written before the runs, at their edges."""
    from braixdet.pipeline.methods import METHODS
    from braixdet.pipeline.results import paired_effect

    script = load_tool("experiment_mv_cost", folder="benchmarks")
    grid = {"faster_rcnn": [80, 70, 75], "faster_rcnn_mvccl_init": [79, 71, 75],
            "faster_rcnn_mv_sv_init": [74, 64, 70], "faster_rcnn_mv": [73, 65, 69]}
    per_seed = [{"results": {METHODS[k].label: {"bbox": {"AP20": v[i]}} for k, v in grid.items()}}
                for i in range(3)]
    effects = script.effects_of(per_seed)
    want = paired_effect(grid["faster_rcnn_mv"], grid["faster_rcnn"])
    assert {k: effects["MV cost, as in Table 6"][k] for k in want} == want
    assert effects["init, multi-view detector"]["mean"] == pytest.approx(-1 / 3)
    both = paired_effect([76, 68, 72], [77, 67, 72.5])  # per seed, the two inits' means
    assert effects[script.BOTH_INITS]["mean"] == pytest.approx(both["mean"]) == -1 / 6
    assert effects[script.BOTH_INITS]["ci_high"] == pytest.approx(both["ci_high"])
    assert script.verdict(effects) == "architecture (the multi-view detector)"

    def e(lo, hi):
        return {"ci_low": lo, "ci_high": hi}

    arch, init = e(-9, -1), e(-2, 2)
    cases = [
        ((e(-9, -0.01), arch, arch, init, init), "architecture (the multi-view detector)"),
        ((e(-9, -0.01), init, init, arch, arch), "initialisation (the BRAIxMVCCL export)"),
        ((e(-9, 0.0), arch, arch, init, init), "no deficit whose 95% interval excludes 0: "
                                               "not attributed"),
        ((e(-9, -1), arch, e(-3, 1), init, init), "not attributed at this precision"),
        ((e(-9, -1), arch, arch, init, e(-3, -0.5)), "not attributed at this precision"),
    ]
    for values, answer in cases:
        assert script.verdict(dict(zip(script.EFFECTS, values))) == answer, values
    # a part of the grid (--rows): only the effects its rows give, and no verdict
    pair = ["faster_rcnn", "faster_rcnn_mv_sv_init"]
    part = [{"results": {METHODS[k].label: s["results"][METHODS[k].label] for k in pair}}
            for s in per_seed]
    sub = script.effects_of(part, rows=pair)
    assert list(sub) == ["detector, single-view classifier init"]
    assert sub["detector, single-view classifier init"]["mean"] == pytest.approx(-17 / 3)
    text, _, answer = script.report(part, "root", [0, 1, 2], pair)
    assert answer.startswith("not read") and "BRAIxMVCCL init" not in text
    with pytest.raises(SystemExit) as exit_:
        script.main(["--help"])
    assert exit_.value.code == 0 and "--protocol" in capsys.readouterr().out


def test_plot_validation_curves_marks_the_evaluation_the_export_rule_keeps(tmp_path, capsys,
                                                                           load_tool):
    """plot_validation_curves.py on metrics.json files written by detectron2's JSONWriter, as
    training writes them: the validation key only (not the test set's, not a training scalar),
    the first best evaluation (max for AP, min for a BCE, as the export rule), a torn last line
    skipped."""
    import cv2
    from detectron2.utils.events import EventStorage, JSONWriter

    def write_run(folder, values, key):
        folder.mkdir()
        writer = JSONWriter(str(folder / "metrics.json"))
        with EventStorage(0) as storage:
            for k, v in enumerate(values):
                storage.iter = 100 * (k + 1) - 1
                storage.put_scalars(**{f"cbis_ddsm_val_s0/{key}": v,
                                       f"cbis_ddsm_test/{key}": 99.0 - v, "total_loss": 0.5},
                                    smoothing_hint=False)
                writer.write()
        writer.close()
        with open(folder / "metrics.json", "a") as f:
            f.write('{"iteration": 999, "cbis_ddsm_val_s0/')  # a run killed mid-write

    script = load_tool("plot_validation_curves", folder="benchmarks")
    write_run(tmp_path / "floor", [65.0, 65.1, 62.9, 65.1], "bbox/AP20")
    write_run(tmp_path / "ceiling", [61.6, 79.3, 77.7], "bbox/AP20")
    write_run(tmp_path / "classifier", [0.63, 0.56, 0.62], "classification/BCE")
    out = tmp_path / "curves.png"
    script.main([f"floor={tmp_path / 'floor'}", f"ceiling={tmp_path / 'ceiling/metrics.json'}",
                 "--out", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "floor: best bbox/AP20 65.1 at evaluation 2 of 4 (iteration 199)"
    assert lines[1] == "ceiling: best bbox/AP20 79.3 at evaluation 2 of 3 (iteration 199)"
    image = cv2.imread(str(out))
    assert image is not None and image.shape[0] > 100 and image.std() > 0
    script.main([f"stage 1={tmp_path / 'classifier'}", "--metric", "classification/BCE",
                 "--out", str(tmp_path / "bce.png")])
    assert capsys.readouterr().out.startswith(
        "stage 1: best classification/BCE 0.56 at evaluation 2 of 3 (iteration 199)")
    with pytest.raises(SystemExit, match="expected one '_val' dataset with bbox/AP20, found none"):
        script.main([f"stage 1={tmp_path / 'classifier'}", "--out", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit, match="nowhere: no such file"):
        script.main([f"x={tmp_path / 'nowhere'}", "--out", str(tmp_path / "x.png")])


def test_aux_view_swaps_change_only_the_second_view(capsys, load_tool):
    """experiment_aux_view.py (RESULTS §24): 'main' shows the main image twice; 'other breast'
    the expected view type of another patient's breast with the same laterality."""
    script = load_tool("experiment_aux_view", folder="benchmarks")
    other_view = {"CC": "MLO", "MLO": "CC"}
    dicts = [{"file_name": f"{p}_{lat}_{v}", "aux_file_name": f"{p}_{lat}_{other_view[v]}",
              "patient_id": p, "laterality": lat, "view": v, "annotations": [p]}
             for p in ("a", "b", "c") for lat in ("L", "R") for v in ("CC", "MLO")]
    assert script.swap_aux(dicts, "paired") == dicts
    main = script.swap_aux(dicts, "main")
    assert all(d["aux_file_name"] == d["file_name"] for d in main)
    other = script.swap_aux(dicts, "other breast", seed=1)
    for d, o in zip(dicts, other):
        patient, lat, view = o["aux_file_name"].split("_")
        assert patient != d["patient_id"] and lat == d["laterality"] and view != d["view"]
        assert {k: v for k, v in o.items() if k != "aux_file_name"} == \
            {k: v for k, v in d.items() if k != "aux_file_name"}  # boxes, labels kept
    assert dicts[0]["aux_file_name"] == "a_L_MLO"  # the input is not modified
    assert script.swap_aux(dicts, script.LCM_OFF) == dicts  # the images as paired
    # the LCM weight scale of a freshly initialised module: identity diagonal, initial std
    import torch

    from braixdet.modeling.lcm import LocalCoOccurrenceModule

    torch.manual_seed(0)
    lcm = LocalCoOccurrenceModule(320, bidirectional=False)
    std, init, diag = script.lcm_cross_view_scale(
        {f"backbone.bottom_up.lcm.{k}": v for k, v in lcm.state_dict().items()})
    assert diag == 1.0 and init == pytest.approx(0.1 / 128 ** 0.5)
    assert std == pytest.approx(init, rel=0.05)
    big = LocalCoOccurrenceModule(320, bidirectional=False, cross_view_init_gain=1.0)
    std, init, _ = script.lcm_cross_view_scale(
        {f"lcm.{k}": v for k, v in big.state_dict().items()}, gain=1.0)
    assert init == pytest.approx(128 ** -0.5) and std == pytest.approx(init, rel=0.05)
    # lcm_probe on a model whose forward runs the LCM once per batch: the cross-view share is
    # the fuse conv's cross-view part against its own-feature part, the entropy in (0, 1]
    from types import SimpleNamespace

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = SimpleNamespace(bottom_up=SimpleNamespace(lcm=lcm))
            self.lcm = lcm

        def forward(self, batch):
            return lcm.to_main(*batch)

    u, v = torch.randn(1, 320, 4, 2), torch.randn(1, 320, 4, 2)
    entropy, share = script.lcm_probe(Model().eval(), [(u, v)])
    fuse = lcm.to_main.fuse.weight
    with torch.no_grad():  # a fresh fuse is identity on u: the rest is the cross-view part
        f = lcm.to_main(u, v) - torch.nn.functional.conv2d(u, fuse[:, :320]) \
            - lcm.to_main.fuse.bias[None, :, None, None]
    assert 0 < entropy <= 1
    assert share == pytest.approx(float(f.norm() / u.norm()), rel=1e-4)
    before = {k: v.clone() for k, v in lcm.state_dict().items()}
    with script.lcm_cross_view_off(Model()), torch.no_grad():
        off = lcm.to_main(u, v)  # the own part alone: the identity plus the (zero) bias
        assert torch.allclose(off, u, atol=1e-6)
    assert all(torch.equal(before[k], w) for k, w in lcm.state_dict().items())  # restored
    with pytest.raises(SystemExit) as exit_:
        script.main(["--help"])
    assert exit_.value.code == 0 and "--runs" in capsys.readouterr().out


def test_lcm_grad_recorder_drift_tells_a_steady_gradient_from_noise(capsys, load_tool):
    """experiment_lcm_grad.py (RESULTS §25): drift is 1 for a gradient of constant direction
    and near the noise floor sqrt(2/(πT)) for random signs; the fuse conv is split into its
    own and cross-view parts; "moved" is ||w_T - w_0|| / ||w_0||."""
    import math

    import torch
    from torch import nn

    from braixdet.modeling.lcm import CrossViewAttention

    script = load_tool("experiment_lcm_grad", folder="benchmarks")
    torch.manual_seed(0)
    model = nn.Module()
    model.cva = CrossViewAttention(16, embed_dim=8, num_heads=2, out_dim=8)
    weights = script.tracked_weights(model)
    assert set(weights) == {"cva.fuse, cross-view part", "cva.fuse, own part", "cva.q_proj",
                            "cva.k_proj", "cva.v_proj", "cva.out_proj"}
    recorder = script.GradientRecorder(weights)
    fuse = model.cva.fuse.weight
    w0 = fuse.detach().clone()
    g = torch.Generator().manual_seed(1)
    steps = 400
    for _ in range(steps):
        grad = torch.zeros_like(fuse)
        grad[:, :16] = 0.5  # own part: a steady direction
        grad[:, 16:] = torch.randn(fuse[:, 16:].shape, generator=g)  # cross-view part: noise
        fuse.grad = grad
        recorder.after_step()
    with torch.no_grad():
        fuse[:, 16:] += 1.0
    out = recorder.summary()
    assert out["steps"] == steps
    assert out["noise_floor"] == pytest.approx((2 / (math.pi * steps)) ** 0.5)
    rows = out["weights"]
    assert rows["cva.fuse, own part"]["drift"] == pytest.approx(1.0)
    assert rows["cva.fuse, cross-view part"]["drift"] == pytest.approx(out["noise_floor"], rel=0.1)
    assert "cva.q_proj" not in rows  # no gradient reached it
    cross = w0[:, 16:]
    assert rows["cva.fuse, cross-view part"]["moved"] == pytest.approx(
        float(torch.ones_like(cross).norm() / cross.norm()), rel=1e-5)
    assert rows["cva.fuse, own part"]["moved"] == 0.0
    assert "| cva.fuse, own part | 1.000 |" in script.report(out)
    with pytest.raises(SystemExit) as exit_:
        script.main(["--help"])
    assert exit_.value.code == 0 and "--config" in capsys.readouterr().out


def test_late_fusion_rescorings_on_an_exact_case(tmp_path, load_tool):
    """experiment_late_fusion.py (RESULTS §26): breast A has a lesion in both views, found at
    0.6 in each; breast B has none, and a false positive at 0.9 on its CC, nothing on its MLO.
    As saved the FP ranks first (AP < 1); late fusion multiplies it by B-MLO's top score (none:
    0) and the TPs by 0.6, so AP is 1; self-gating keeps the FP first; the oracle demotes it.
    The saved COCO files round-trip through load_saved (xywh -> xyxy, ids by image name)."""
    import json

    import numpy as np

    from braixdet.evaluation.metrics import average_precision

    script = load_tool("experiment_late_fusion", folder="benchmarks")
    lesion = [10.0, 10.0, 20.0, 20.0]  # xywh
    images = ["A_L_CC", "A_L_MLO", "B_R_CC", "B_R_MLO"]
    gt = {"images": [{"id": k + 1, "braixdet_image_id": n} for k, n in enumerate(images)],
          "annotations": [{"image_id": 1, "bbox": lesion}, {"image_id": 2, "bbox": lesion}]}
    saved = [{"image_id": 1, "bbox": lesion, "score": 0.6},
             {"image_id": 2, "bbox": lesion, "score": 0.6},
             {"image_id": 3, "bbox": [50.0, 50.0, 10.0, 10.0], "score": 0.9}]
    (tmp_path / "gt_coco.json").write_text(json.dumps(gt))
    (tmp_path / "detections_coco.json").write_text(json.dumps(saved))
    gts, dets = script.load_saved(str(tmp_path))
    assert gts["B_R_MLO"].shape == (0, 4) and gts["A_L_CC"].tolist() == [[10, 10, 30, 30]]
    assert dets["B_R_CC"][0].tolist() == [[50, 50, 60, 60]] and "B_R_MLO" not in dets
    aux_of = {"A_L_CC": "A_L_MLO", "A_L_MLO": "A_L_CC", "B_R_CC": "B_R_MLO",
              "B_R_MLO": "B_R_CC"}
    r = script.rescorings(gts, dets, aux_of)
    assert r["late fusion"]["B_R_CC"][1].tolist() == [0.0]
    assert np.allclose(r["late fusion"]["A_L_CC"][1], [0.36])
    assert np.allclose(r["self"]["B_R_CC"][1], [0.81])
    assert np.allclose(r["oracle"]["B_R_CC"][1], [0.009])
    ap = {k: average_precision(gts, d, iou_thresh=0.2) for k, d in r.items()}
    # as saved: precision 1/2 at recall 0.5, 2/3 at recall 1: the envelope is 2/3 throughout
    assert ap["as saved"] == pytest.approx(2 / 3, abs=1e-9)
    assert ap["self"] == pytest.approx(ap["as saved"])
    assert ap["late fusion"] == pytest.approx(1.0) and ap["oracle"] == pytest.approx(1.0)
    # one exam: every bootstrap draw is the whole split, so each interval is the point effect
    one = script.bootstrap_effects(gts, r, {i: "exam" for i in images}, resamples=3)
    assert one["late fusion − as saved"] == pytest.approx((100 / 3, 100 / 3))
    assert one["self − as saved"] == pytest.approx((0.0, 0.0))
    # a stage-1 classifier's probabilities as a gate, read from its predictions CSV
    csv_dir = tmp_path / "clf" / "inference" / "model" / "t_cls"
    csv_dir.mkdir(parents=True)
    (csv_dir / "classification_predictions.csv").write_text(
        "image_id,label,prob\nA_L_CC,1,0.5\nA_L_MLO,1,0.5\nB_R_CC,0,0.1\nB_R_MLO,0,0.2\n")
    gate = script.read_gate(str(tmp_path / "clf"), "t")
    g = script.rescorings(gts, dets, aux_of, {"clf": gate})["gate clf"]
    assert np.allclose(g["A_L_CC"][1], [0.3]) and np.allclose(g["B_R_CC"][1], [0.09])
    assert average_precision(gts, g, iou_thresh=0.2) == pytest.approx(1.0)
    assert script.effects_of(["m", "s"])[-3:] == (("gate m", "as saved"), ("gate s", "as saved"),
                                                  ("gate m", "gate s"))
    assert script.effects_of([], ["E5", "F"])[-3:] == (("row E5", "as saved"),
                                                       ("row F", "as saved"), ("row E5", "row F"))
    # another row's saved detections on the same test images: here the late-fused ones
    other = tmp_path / "other" / "inference" / "model" / "t"
    other.mkdir(parents=True)
    (other / "gt_coco.json").write_text(json.dumps(gt))
    (other / "detections_coco.json").write_text(json.dumps([dict(d, score=s) for d, s in zip(
        saved, [0.36, 0.36, 0.0])]))
    dets_other = script.load_other(str(other), gts)
    assert average_precision(gts, dets_other, iou_thresh=0.2) == pytest.approx(1.0)
    gt["annotations"].pop()  # another split: refused
    (other / "gt_coco.json").write_text(json.dumps(gt))
    with pytest.raises(SystemExit, match="its test split is not this row's"):
        script.load_other(str(other), gts)
