"""Register a mammography dataset's protocol splits in detectron2's catalogs.

Five names per (dataset, protocol, ratio, seed), all backed by ONE lazy load of the source:
``{name}_train_full_{rtag}_s{seed}``, ``{name}_train_weak_{rtag}_s{seed}``,
``{name}_train_all_s{seed}``, ``{name}_val_s{seed}``, ``{name}_test``.
The bad-input report goes to ``<split_dir>/<name>_report.json``, the split to
``<split_dir>/<name>_split_{rtag}_s{seed}.json``; nothing is written inside the dataset root.
"""
import logging
import os
import threading

from detectron2.data import DatasetCatalog, MetadataCatalog

from .datasets import LOADERS
from .datasets.common import is_under
from .protocols import ROLES, parse_ratio, ratio_tag, split_dataset
from .report import BadInputReport

logger = logging.getLogger(__name__)

_LOADED = {}  # registration key -> {role: dicts}
_LOCK = threading.Lock()


def dataset_names(name, protocol, ratio, seed):
    rtag = ratio_tag(protocol, ratio)
    return {
        "train_full": f"{name}_train_full_{rtag}_s{seed}",
        "train_weak": f"{name}_train_weak_{rtag}_s{seed}",
        "train_all": f"{name}_train_all_s{seed}",
        "val": f"{name}_val_s{seed}",
        "test": f"{name}_test",
    }


def _load_all(key, fmt, root, csv, name, protocol, ratio, seed, val_fraction, split_file,
              report_path, on_bad_input, malignant_birads, allow_for_processing):
    with _LOCK:
        if key in _LOADED:
            return _LOADED[key]
        report = BadInputReport(name, on_bad_input)
        if fmt == "cbis_ddsm":
            dicts = LOADERS[fmt](root, report, allow_for_processing=allow_for_processing)
        elif fmt == "vindr_mammo":
            dicts = LOADERS[fmt](root, report, malignant_birads=malignant_birads,
                                 allow_for_processing=allow_for_processing)
        else:
            dicts = LOADERS[fmt](csv or "exams.csv", root, report,
                                 allow_for_processing=allow_for_processing)
        report.save(report_path)
        print(report.summary())
        if not dicts:
            raise RuntimeError(f"{name}: no usable image in {root} (see {report_path})")
        _LOADED[key] = split_dataset(dicts, protocol, ratio, seed, val_fraction, split_file)
        return _LOADED[key]


def register_braixdet_datasets(fmt, root, name=None, protocol="partial", ratio="1/8", seed=0,
                               val_fraction=0.1, split_dir=None, on_bad_input="skip", csv=None,
                               malignant_birads=(4, 5), allow_for_processing=False):
    """Register the five role datasets (lazily loaded) and return {role: registered name}.

    ``fmt``: cbis_ddsm | vindr_mammo | exam_csv. Calling again with the same arguments is a
    no-op; with other arguments under the same names, the old registration is replaced.
    """
    if fmt not in LOADERS:
        raise ValueError(f"unknown dataset format {fmt!r}; one of {sorted(LOADERS)}")
    if not root or not os.path.isdir(root):
        raise FileNotFoundError(f"dataset root {root!r} is not a folder")
    if protocol == "partial":
        parse_ratio(ratio)  # fail early on a bad ratio
    root = os.path.abspath(root)
    name = name or fmt
    seed = int(seed)
    split_dir = os.path.abspath(split_dir or os.path.join("output", "splits"))
    if is_under(split_dir, root):
        raise ValueError(f"split_dir {split_dir} is inside the dataset root (read only)")
    names = dataset_names(name, protocol, ratio, seed)
    rtag = ratio_tag(protocol, ratio)
    split_file = os.path.join(split_dir, f"{name}_split_{rtag}_s{seed}.json")
    report_path = os.path.join(split_dir, f"{name}_report.json")
    malignant_birads = tuple(int(b) for b in malignant_birads)
    key = (fmt, root, csv, name, protocol, str(parse_ratio(ratio)) if protocol == "partial"
           else "1", seed, float(val_fraction), split_dir, on_bad_input, malignant_birads,
           bool(allow_for_processing))
    args = (key, fmt, root, csv, name, protocol, ratio, seed, float(val_fraction), split_file,
            report_path, on_bad_input, malignant_birads, bool(allow_for_processing))

    for role in ROLES:
        ds_name = names[role]
        meta = {"thing_classes": ["malignant"], "evaluator_type": "mammo", "root": root,
                "report_path": report_path, "split_file": split_file, "role": role,
                "protocol": protocol, "ratio": rtag, "seed": seed, "dataset_format": fmt,
                # the test set does not depend on protocol/ratio/seed/val_fraction
                "registration_key": repr(key if role != "test" else key[:4] + key[-3:])}
        if ds_name in DatasetCatalog.list():
            old = MetadataCatalog.get(ds_name).get("registration_key", None)
            if old == meta["registration_key"]:
                continue  # same registration: idempotent
            logger.warning("Re-registering %s with other arguments", ds_name)
            DatasetCatalog.remove(ds_name)
            MetadataCatalog.remove(ds_name)
        DatasetCatalog.register(ds_name, lambda role=role: list(_load_all(*args)[role]))
        MetadataCatalog.get(ds_name).set(**meta)
    return names


def register_from_cfg(cfg):
    """register_braixdet_datasets from cfg.DATASETS.BRAIXDET.*; returns {role: name}."""
    b = cfg.DATASETS.BRAIXDET
    split_dir = b.SPLIT_DIR or os.path.join(cfg.OUTPUT_DIR, "splits")
    return register_braixdet_datasets(
        b.FORMAT, b.ROOT, name=b.NAME or None, protocol=b.PROTOCOL, ratio=b.RATIO,
        seed=b.SEED, val_fraction=b.VAL_FRACTION, split_dir=split_dir,
        on_bad_input=b.ON_BAD_INPUT, csv=b.CSV or None,
        malignant_birads=tuple(b.VINDR_MALIGNANT_BIRADS),
        allow_for_processing=cfg.INPUT.BRAIXDET.get("ALLOW_FOR_PROCESSING", False))
