"""Protocols (patient-wise splits, D_s/D_w) and catalog registration."""
import hashlib
import json
import os

import pytest
from detectron2.data import DatasetCatalog, MetadataCatalog

from braixdet.config import build_cfg
from braixdet.data.protocols import compute_split, parse_ratio, ratio_tag, split_dataset
from braixdet.data.register import register_braixdet_datasets, register_from_cfg


def _fake_dicts(n_patients=160, seed_shift=0):
    """4 images per patient; ~half the patients have a malignant fully annotated breast."""
    dicts = []
    for p in range(n_patients):
        for lat in "LR":
            for view in ("CC", "MLO"):
                label = int(lat == "L" and p % 2 == 0)
                full = p % 5 != 0  # some weak patients
                d = {"image_id": f"p{p:03d}_{lat}_{view}", "patient_id": f"pat{p:03d}",
                     "exam_id": f"e{p}", "laterality": lat, "view": view, "label": label,
                     "split": "test" if p % 10 == 3 else "train",
                     "annotation_type": "full" if full else "weak"}
                if full:
                    d["annotations"] = [{"bbox": [1, 1, 5, 5], "bbox_mode": 0,
                                         "category_id": 0}] * label
                dicts.append(d)
    return dicts


def _patients(ds):
    return {d["patient_id"] for d in ds}


@pytest.mark.parametrize("ratio", ["1/16", "1/8", 0.25, "1/2", "3/4"])
def test_partial_ratios_and_disjointness(ratio):
    dicts = _fake_dicts()
    src = {d["image_id"]: d for d in dicts}
    out = split_dataset(dicts, "partial", ratio, seed=0, val_fraction=0.1)
    train, val, test = (_patients(out[k]) for k in ("train_all", "val", "test"))
    assert not (train & val) and not (train & test) and not (val & test)
    assert _patients(out["test_cls"]) == _patients(d for d in dicts if d["split"] == "test")
    n_train = len(_patients(d for d in dicts if d["split"] == "train"))
    val_all = {d["patient_id"] for d in dicts if d["split"] == "train"} - train
    assert len(val_all) == round(0.1 * n_train)
    # validation and detection test hold fully annotated images only; test_cls every test image
    for role in ("val", "test"):
        assert out[role] and all(src[d["image_id"]]["annotation_type"] == "full"
                                 for d in out[role])
    assert len(out["test_cls"]) == sum(d["split"] == "test" for d in dicts)
    # the ratio is over the fully annotated subset, stratified by malignancy
    full_pats = {d["patient_id"] for d in out["train_all"]
                 if src[d["image_id"]]["annotation_type"] == "full"}
    malignant = {p for p in full_pats if any(
        d["patient_id"] == p and d["label"] == 1 for d in out["train_all"])}
    kept = _patients(out["train_full"])
    r = float(parse_ratio(ratio))
    assert len(kept & malignant) == max(1, round(r * len(malignant)))
    assert len(kept - malignant) == round(r * len(full_pats - malignant))
    assert not (kept & _patients(d for d in out["train_weak"]
                                 if src[d["image_id"]]["annotation_type"] == "full"))
    ids = lambda k: {d["image_id"] for d in out[k]}  # noqa: E731
    assert ids("train_full") | ids("train_weak") == ids("train_all")
    assert not ids("train_full") & ids("train_weak")
    assert all("annotations" not in d and d["annotation_type"] == "weak"
               for d in out["train_weak"])
    # boxes of converted images are kept aside (pseudo-label quality), never as annotations
    assert all(d["withheld_annotations"] == src[d["image_id"]]["annotations"]
               for d in out["train_weak"] if src[d["image_id"]]["annotation_type"] == "full")
    assert all("annotations" in d for d in out["train_full"])
    # inputs untouched
    assert all("annotations" in d for d in dicts if d["annotation_type"] == "full")


def _crafted():
    """40 training patients + 4 test patients, one exam each (L and R breast, CC + MLO):
    pat00-15: full, malignant left breast; pat16-31: full, lesion-free; pat32-39: weak cancers
    (left) with a weak lesion-free right breast. Test: one of each kind + one mixed patient."""
    dicts = []

    def add(p, split, ann, label_left):
        for lat in "LR":
            for view in ("CC", "MLO"):
                label = int(lat == "L" and label_left)
                kind = ann if isinstance(ann, str) else ann[lat]
                d = {"image_id": f"{p}_{lat}_{view}", "patient_id": p, "exam_id": p,
                     "laterality": lat, "view": view, "label": label, "split": split,
                     "annotation_type": kind}
                if kind == "full":
                    d["annotations"] = [{"bbox": [1, 1, 9, 9], "bbox_mode": 0,
                                         "category_id": 0}] * label
                dicts.append(d)

    for i in range(40):
        add(f"pat{i:02d}", "train", "weak" if i >= 32 else "full", i < 16 or i >= 32)
    add("tst_mal", "test", "full", True)
    add("tst_free", "test", "full", False)
    add("tst_weak", "test", "weak", True)
    add("tst_mixed", "test", {"L": "weak", "R": "full"}, True)
    return dicts


def test_protocol_composition_at_one_eighth_on_a_crafted_dataset():
    """Counts per role exactly as datasets/README.md documents them."""
    dicts = _crafted()
    out = split_dataset(dicts, "partial", "1/8", seed=0, val_fraction=0.1)
    val_pats = _patients(out["val"])
    assert len(val_pats) == 4  # round(0.1 * 40)
    val_full = [d for d in dicts if d["patient_id"] in val_pats and d["annotation_type"] == "full"]
    assert sorted(d["image_id"] for d in out["val"]) == sorted(d["image_id"] for d in val_full)
    left = [p for p in (f"pat{i:02d}" for i in range(40)) if p not in val_pats]
    mal = [p for p in left if int(p[3:]) < 16]
    free = [p for p in left if 16 <= int(p[3:]) < 32]
    weak = [p for p in left if int(p[3:]) >= 32]
    ds = _patients(out["train_full"])
    assert not ds & set(weak)  # patients without a full image are never in D_s
    assert len(ds & set(mal)) == max(1, round(len(mal) / 8))
    assert len(ds & set(free)) == round(len(free) / 8)
    assert len(out["train_full"]) == 4 * len(ds)
    assert len(out["train_weak"]) == 4 * (len(left) - len(ds))
    assert len(out["train_all"]) == 4 * len(left)
    # test: the fully annotated images (3 patients: 4 + 4 + 2); weak cancers never scored
    assert sorted(d["image_id"] for d in out["test"]) == sorted(
        [f"tst_mal_{s}" for s in ("L_CC", "L_MLO", "R_CC", "R_MLO")]
        + [f"tst_free_{s}" for s in ("L_CC", "L_MLO", "R_CC", "R_MLO")]
        + ["tst_mixed_R_CC", "tst_mixed_R_MLO"])
    assert len(out["test_cls"]) == 16
    neg = split_dataset(dicts, "partial", "1/8", seed=0, test_images="full+negatives")["test"]
    assert {d["image_id"] for d in neg} - {d["image_id"] for d in out["test"]} == {
        "tst_weak_R_CC", "tst_weak_R_MLO"}  # weak lesion-free added; weak cancers still out
    assert all(d["label"] == 0 or d["annotation_type"] == "full" for d in neg)


def test_full_protocol():
    dicts = _fake_dicts()
    out = split_dataset(dicts, "full", seed=0)
    src = {d["image_id"]: d for d in dicts}
    assert all(src[d["image_id"]]["annotation_type"] == "full" for d in out["train_full"])
    assert all(src[d["image_id"]]["annotation_type"] == "weak" for d in out["train_weak"])
    assert ratio_tag("full", "1/8") == "full" and ratio_tag("partial", 0.0625) == "r1_16"
    with pytest.raises(ValueError):
        parse_ratio("3/2")


def test_the_three_protocols_by_name():
    """partial (Tables 2/4), full = every box-annotated image + the extra weak images (Tables 3
    and 6), supervised_only = every box-annotated image and no weak image anywhere (Table 5)."""
    dicts = _fake_dicts()
    full = compute_split(dicts, "full", seed=0)
    sup = compute_split(dicts, "supervised_only", seed=0)
    part = compute_split(dicts, "partial", ratio="1/2", seed=0)
    src = {d["image_id"]: d for d in dicts}
    weak_train = sorted(i for i in full["train_all"] if src[i]["annotation_type"] == "weak")
    assert full["train_weak"] == weak_train and weak_train  # every extra weak training image
    assert sup["train_full"] == full["train_full"] and sup["train_weak"] == []
    assert sup["train_all"] == sup["train_full"]  # stage 1 sees no weak image either
    assert sup["val"] == full["val"] == part["val"] and sup["test"] == full["test"]
    assert len(part["train_full"]) < len(full["train_full"])
    assert ratio_tag("supervised_only", "1/8") == "supervised_only"
    with pytest.raises(ValueError, match="protocol must be one of"):
        compute_split(dicts, "supervised")


def test_split_json_seed_and_reuse(tmp_path):
    dicts = _fake_dicts()
    f0, f0b, f1 = (str(tmp_path / n) for n in ("s0.json", "s0b.json", "s1.json"))
    split_dataset(dicts, "partial", "1/8", seed=0, split_file=f0)
    split_dataset(list(reversed(dicts)), "partial", 0.125, seed=0, split_file=f0b)
    split_dataset(dicts, "partial", "1/8", seed=1, split_file=f1)
    read = lambda p: open(p).read()  # noqa: E731
    assert read(f0) == read(f0b)  # input order and ratio spelling do not matter
    a, b = json.loads(read(f0)), json.loads(read(f1))
    assert a["val"] != b["val"] and a["train_full"] != b["train_full"]
    assert a["params"]["seed"] == 0 and a["params"]["ratio"] == "1/8"
    # reuse: an existing file with the same parameters is read, not recomputed
    moved = a["train_full"].pop()
    a["train_weak"].append(moved)
    with open(f0, "w") as f:
        json.dump(a, f)
    out = split_dataset(dicts, "partial", "1/8", seed=0, split_file=f0)
    assert moved in {d["image_id"] for d in out["train_weak"]}
    # other parameters -> recomputed and overwritten
    split_dataset(dicts, "partial", "1/4", seed=0, split_file=f0)
    assert json.loads(read(f0))["params"]["ratio"] == "1/4"
    assert compute_split(dicts, seed=3) == compute_split(dicts, seed=3)


def _tree_digest(root):
    h = hashlib.sha256()
    for dirpath, dirnames, files in os.walk(root):
        dirnames.sort()
        for name in sorted(files):
            p = os.path.join(dirpath, name)
            st = os.stat(p)
            h.update(f"{os.path.relpath(p, root)}|{st.st_size}|{st.st_mtime_ns}".encode())
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest(), sorted(os.listdir(root))


def test_register_and_dataset_folder_untouched(synthetic_root, tmp_path):
    from braixdet.data.mapper import MultiViewDatasetMapper

    before = _tree_digest(synthetic_root.root)
    split_dir = str(tmp_path / "splits")
    kw = dict(name="synthreg", protocol="partial", ratio="1/2", seed=0, split_dir=split_dir)
    names = register_braixdet_datasets("cbis_ddsm", synthetic_root.root, **kw)
    assert names == {"train_full": "synthreg_train_full_r1_2_s0",
                     "train_weak": "synthreg_train_weak_r1_2_s0",
                     "train_all": "synthreg_train_all_s0", "val": "synthreg_val_s0",
                     "test": "synthreg_test", "test_cls": "synthreg_test_cls"}
    assert register_braixdet_datasets("cbis_ddsm", synthetic_root.root, **kw) == names
    sets = {k: DatasetCatalog.get(v) for k, v in names.items()}
    truth = synthetic_root.summary["truth"]
    assert len(sets["test"]) == sum(bool(t["lesions"]) for t in truth if t["split"] == "test")
    assert len(sets["test_cls"]) == len(sets["test"])  # CBIS: every listed image is full
    assert len(sets["train_all"]) + len(sets["val"]) + len(sets["test"]) == sum(
        bool(t["lesions"]) for t in truth)
    meta = MetadataCatalog.get(names["train_full"])
    assert meta.thing_classes == ["malignant"] and meta.evaluator_type == "mammo"
    assert os.path.isfile(meta.report_path) and os.path.isfile(meta.split_file)
    assert os.path.dirname(meta.report_path) == split_dir
    report = json.load(open(meta.report_path))
    assert report["num_bad"] == 0 and report["name"] == "synthreg"
    raw = {t["PatientName"] for t in truth} | {t["PatientID"] for t in truth}
    text = open(meta.report_path).read() + open(meta.split_file).read()
    assert not any(r in text for r in raw)
    # another seed: new train/val names, the test name is shared and stays valid
    names1 = register_braixdet_datasets("cbis_ddsm", synthetic_root.root,
                                        **dict(kw, seed=1))
    assert names1["test"] == names["test"] and names1["val"] == "synthreg_val_s1"
    assert len(DatasetCatalog.get(names1["train_all"])) + len(DatasetCatalog.get(
        names1["val"])) == len(sets["train_all"]) + len(sets["val"])
    # map every image: still nothing written in the dataset folder
    mapper = MultiViewDatasetMapper(True, canonical_size=(128, 64),
                                    cache_dir=str(tmp_path / "cache"))
    for d in sets["train_all"] + sets["test"]:
        assert mapper(dict(d, _draw=0)) is not None
    assert _tree_digest(synthetic_root.root) == before


def test_register_from_cfg(synthetic_root, tmp_path):
    cfg = build_cfg(opts=["OUTPUT_DIR", str(tmp_path / "out"), "DATASETS.BRAIXDET.FORMAT",
                          "exam_csv", "DATASETS.BRAIXDET.ROOT", synthetic_root.root,
                          "DATASETS.BRAIXDET.CSV", "exams.csv", "DATASETS.BRAIXDET.NAME",
                          "synthcfg", "DATASETS.BRAIXDET.PROTOCOL", "full",
                          "DATASETS.BRAIXDET.SEED", "2"])
    names = register_from_cfg(cfg)
    assert names["train_full"] == "synthcfg_train_full_full_s2"
    weak = DatasetCatalog.get(names["train_weak"])
    assert weak and all(d["annotation_type"] == "weak" for d in weak)
    assert os.path.isfile(os.path.join(cfg.OUTPUT_DIR, "splits", "synthcfg_report.json"))
    with pytest.raises(ValueError):  # split files must not go into the dataset folder
        register_braixdet_datasets("exam_csv", synthetic_root.root, name="x",
                                   split_dir=os.path.join(synthetic_root.root, "splits"))


def test_paper_test_set_is_the_fully_annotated_cancer_images(tmp_path):
    """TEST_IMAGES "paper" (paper §4.1): no lesion-free image, no weak cancer; "full" adds the
    fully annotated lesion-free images; the name and metadata say which one was registered."""
    dicts = _crafted()
    paper = split_dataset(dicts, "partial", "1/8", seed=0, test_images="paper")
    full = split_dataset(dicts, "partial", "1/8", seed=0, test_images="full")
    assert [d["image_id"] for d in paper["test"]] == ["tst_mal_L_CC", "tst_mal_L_MLO"]
    assert all(d["label"] == 1 for d in full["test"] if d["image_id"].startswith("tst_mal_L"))
    assert len(full["test"]) == 10 and {d["label"] for d in full["test"]} == {0, 1}
    assert paper["test_cls"] == full["test_cls"]  # the classifier's test set is unchanged
    for role in ("train_full", "train_weak", "val"):  # only the test set depends on it
        assert paper[role] == full[role]
    with pytest.raises(ValueError, match="test images"):
        compute_split(dicts, test_images="cancer")


def test_registered_test_set_records_its_composition(synthetic_root, tmp_path):
    from braixdet.evaluation.mammo_evaluator import MammoDetectionEvaluator

    names = register_braixdet_datasets("cbis_ddsm", synthetic_root.root, name="synthpaper",
                                       split_dir=str(tmp_path / "splits"), test_images="paper")
    assert names["test"] == "synthpaper_test_paper"
    test = DatasetCatalog.get(names["test"])
    truth = synthetic_root.summary["truth"]
    assert len(test) == sum(t["split"] == "test" and t["cancer_label"] == 1 for t in truth)
    assert test and all(d["label"] == 1 and d["annotations"] for d in test)
    assert MetadataCatalog.get(names["test"]).test_images == "paper"
    # the evaluator writes it into metrics.json
    ev = MammoDetectionEvaluator(names["test"], output_dir=str(tmp_path / "eval"))
    ev.reset()
    import torch
    from detectron2.structures import Boxes, Instances

    for d in test:
        inst = Instances((d["height"], d["width"]))
        inst.pred_boxes = Boxes(torch.tensor([[0.0, 0.0, 10.0, 10.0]]))
        inst.scores = torch.tensor([0.5])
        inst.pred_classes = torch.tensor([0])
        ev.process([{"image_id": d["image_id"]}], [{"instances": inst}])
    ev.evaluate()
    saved = json.load(open(tmp_path / "eval" / "metrics.json"))
    assert saved["test_images"] == "paper" and saved["num_images"] == len(test)


@pytest.mark.parametrize("ratio,want", [("1", "1/1"), ("1.0", "1/1"), ("0.5", "1/2"),
                                        ("1/8", "1/8")])
def test_pipeline_passes_any_ratio_spelling_the_config_accepts(tmp_path, ratio, want):
    """`run_pipeline.py --ratio 1` (e.g. with --protocol full) reached the config as the int 1,
    which yacs refused (type mismatch with the string key): the pipeline passes "p/q"."""
    import argparse

    from braixdet.config import build_cfg
    from braixdet.pipeline.core import Pipeline, add_pipeline_arguments

    args = add_pipeline_arguments(argparse.ArgumentParser()).parse_args(
        ["--root", str(tmp_path), "--ratio", ratio, "--out", str(tmp_path / "out")])
    common = Pipeline(args).common
    assert common[common.index("DATASETS.BRAIXDET.RATIO") + 1] == want
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = build_cfg(os.path.join(repo, "configs", "demo", "MVCCL", "mvccl.yaml"), common)
    assert cfg.DATASETS.BRAIXDET.RATIO == want
