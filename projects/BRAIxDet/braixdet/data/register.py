"""Register a mammography dataset's protocol splits in detectron2's catalogs.

Six names per (dataset, protocol, ratio, seed), all backed by ONE lazy load of the source:
``{name}_train_full_{rtag}_s{seed}``, ``{name}_train_weak_{rtag}_s{seed}``,
``{name}_train_all_s{seed}``, ``{name}_val_s{seed}``, the detection test set (by
DATASETS.BRAIXDET.TEST_IMAGES, ``TEST_NAMES``: ``{name}_test_paper`` with "paper",
``{name}_test`` with "full", ``{name}_test_full_neg`` with "full+negatives") and
``{name}_test_cls`` (every test image with its label, for the classifier).
The bad-input report goes to ``<split_dir>/<name>_report.json``, the split to
``<split_dir>/<name>_split_{rtag}_s{seed}.json``; nothing is written inside the dataset root.
"""
import dataclasses
import logging
import os
import threading

from detectron2.data import DatasetCatalog, MetadataCatalog

from .datasets import LOADERS
from .datasets.common import is_under
from .protocols import ROLES, TEST_IMAGES, parse_ratio, ratio_tag, saved_split_ids, split_dataset
from .report import BadInputReport

logger = logging.getLogger(__name__)

_LOADED = {}  # RegistrationSpec -> {role: dicts}
_LOCK = threading.Lock()


# the detection test set's name suffix per TEST_IMAGES (protocols.TEST_IMAGES)
TEST_NAMES = {"paper": "test_paper", "full": "test", "full+negatives": "test_full_neg"}


def dataset_names(name, protocol, ratio, seed, test_images="full"):
    rtag = ratio_tag(protocol, ratio)
    return {
        "train_full": f"{name}_train_full_{rtag}_s{seed}",
        "train_weak": f"{name}_train_weak_{rtag}_s{seed}",
        "train_all": f"{name}_train_all_s{seed}",
        "val": f"{name}_val_s{seed}",
        "test": f"{name}_{TEST_NAMES[test_images]}",
        "test_cls": f"{name}_test_cls",
    }


@dataclasses.dataclass(frozen=True)
class RegistrationSpec:
    """Everything one registration depends on, validated and normalised (``from_args``).

    Equal specs are the same registration: they share one lazy load (``_load_all``) and
    registering one again is a no-op. Hashable, so it is the load cache's key.
    """

    format: str  # cbis_ddsm | vindr_mammo | exam_csv
    root: str  # absolute
    csv: str | None  # exam_csv only; None -> "exams.csv"
    name: str
    protocol: str  # partial | full | supervised_only (protocols.PROTOCOLS)
    ratio: str  # normalised: "1/8" for 0.125 or "1/8"; "1" for the other protocols
    seed: int
    val_fraction: float
    split_dir: str  # absolute, outside the root
    on_bad_input: str
    malignant_birads: tuple  # vindr_mammo only
    allow_for_processing: bool
    test_images: str = "full"  # paper | full | full+negatives (protocols.TEST_IMAGES)

    @classmethod
    def from_args(cls, fmt, root, name=None, protocol="partial", ratio="1/8", seed=0,
                  val_fraction=0.1, split_dir=None, on_bad_input="skip", csv=None,
                  malignant_birads=(4, 5), allow_for_processing=False, test_images="full"):
        """The arguments of register_braixdet_datasets, checked; bad ones raise here."""
        if test_images not in TEST_IMAGES:
            raise ValueError(f"DATASETS.BRAIXDET.TEST_IMAGES must be one of {TEST_IMAGES}, "
                             f"got {test_images!r}")
        if fmt not in LOADERS:
            raise ValueError(f"unknown dataset format {fmt!r}; one of {sorted(LOADERS)}")
        if not root or not os.path.isdir(root):
            raise FileNotFoundError(f"dataset root {root!r} is not a folder")
        root = os.path.abspath(root)
        name = name or fmt
        seed = int(seed)
        if not split_dir:  # a config's default is decided by config.build_cfg
            raise ValueError("split_dir is required: the folder for the split JSON and the "
                             "bad-input report (outside the dataset root)")
        split_dir = os.path.abspath(split_dir)
        if is_under(split_dir, root):
            raise ValueError(f"split_dir {split_dir} is inside the dataset root (read only)")
        # only the partial protocol has a ratio (ratio_tag names the others by protocol); a bad
        # one fails here, before anything is loaded
        ratio = "1" if protocol != "partial" else str(parse_ratio(ratio))
        return cls(format=fmt, root=root, csv=csv, name=name, protocol=protocol, ratio=ratio,
                   seed=seed, val_fraction=float(val_fraction), split_dir=split_dir,
                   on_bad_input=on_bad_input,
                   malignant_birads=tuple(int(b) for b in malignant_birads),
                   allow_for_processing=bool(allow_for_processing), test_images=test_images)

    @classmethod
    def from_cfg(cls, cfg):
        """From cfg.DATASETS.BRAIXDET.* of a config from config.build_cfg (which decides the
        split folder)."""
        b = cfg.DATASETS.BRAIXDET
        return cls.from_args(
            b.FORMAT, b.ROOT, name=b.NAME or None, protocol=b.PROTOCOL, ratio=b.RATIO,
            seed=b.SEED, val_fraction=b.VAL_FRACTION, split_dir=b.SPLIT_DIR,
            on_bad_input=b.ON_BAD_INPUT, csv=b.CSV or None,
            malignant_birads=tuple(b.VINDR_MALIGNANT_BIRADS),
            allow_for_processing=cfg.INPUT.BRAIXDET.ALLOW_FOR_PROCESSING,
            test_images=b.TEST_IMAGES)

    @property
    def rtag(self):
        return ratio_tag(self.protocol, self.ratio)

    @property
    def names(self):
        """{role: registered name}."""
        return dataset_names(self.name, self.protocol, self.ratio, self.seed, self.test_images)

    @property
    def split_file(self):
        return os.path.join(self.split_dir, f"{self.name}_split_{self.rtag}_s{self.seed}.json")

    def saved_split(self):
        """{role: image ids} from ``split_file`` when an earlier load of this spec wrote it; None
        otherwise (protocols.saved_split_ids: nothing of the dataset is read)."""
        return saved_split_ids(self.split_file, self.protocol, self.ratio, self.seed,
                               self.val_fraction, self.test_images)

    @property
    def report_path(self):
        return os.path.join(self.split_dir, f"{self.name}_report.json")

    def registration_key(self, role):
        """What must match for an existing registration of ``role`` to be kept as it is.

        The test sets depend only on the source (format, root, csv, name and how it is read)
        and TEST_IMAGES, not on protocol, ratio, seed, val_fraction or split_dir: every
        protocol shares them.
        """
        if role not in ("test", "test_cls"):
            return repr(self)
        return repr((self.format, self.root, self.csv, self.name, self.on_bad_input,
                     self.malignant_birads, self.allow_for_processing, self.test_images))


def _load_all(spec):
    with _LOCK:
        if spec in _LOADED:
            return _LOADED[spec]
        report = BadInputReport(spec.name, spec.on_bad_input)
        loader = LOADERS[spec.format]
        if spec.format == "cbis_ddsm":
            dicts = loader(spec.root, report, allow_for_processing=spec.allow_for_processing)
        elif spec.format == "vindr_mammo":
            dicts = loader(spec.root, report, malignant_birads=spec.malignant_birads,
                           allow_for_processing=spec.allow_for_processing)
        else:
            dicts = loader(spec.csv or "exams.csv", spec.root, report,
                           allow_for_processing=spec.allow_for_processing)
        report.save(spec.report_path)
        print(report.summary())
        if not dicts:
            raise RuntimeError(f"{spec.name}: no usable image in {spec.root} "
                               f"(see {spec.report_path})")
        _LOADED[spec] = split_dataset(dicts, spec.protocol, spec.ratio, spec.seed,
                                      spec.val_fraction, spec.split_file, spec.test_images)
        return _LOADED[spec]


def register(spec):
    """Register the role datasets of ``spec`` (lazily loaded); returns {role: name}.

    Registering an equal spec again is a no-op; another spec under the same names replaces the
    old registration.
    """
    names = spec.names
    for role in ROLES:
        ds_name = names[role]
        meta = {"thing_classes": ["malignant"], "evaluator_type": "mammo", "root": spec.root,
                "report_path": spec.report_path, "split_file": spec.split_file, "role": role,
                "protocol": spec.protocol, "ratio": spec.rtag, "seed": spec.seed,
                "dataset_format": spec.format, "registration_key": spec.registration_key(role)}
        if role == "test":  # the evaluator records which test set it scored
            meta["test_images"] = spec.test_images
        if ds_name in DatasetCatalog.list():
            old = MetadataCatalog.get(ds_name).get("registration_key", None)
            if old == meta["registration_key"]:
                continue  # same registration: idempotent
            logger.warning("Re-registering %s with other arguments", ds_name)
            DatasetCatalog.remove(ds_name)
            MetadataCatalog.remove(ds_name)
        DatasetCatalog.register(ds_name, lambda role=role: list(_load_all(spec)[role]))
        MetadataCatalog.get(ds_name).set(**meta)
    return names


def register_braixdet_datasets(fmt, root, name=None, protocol="partial", ratio="1/8", seed=0,
                               val_fraction=0.1, split_dir=None, on_bad_input="skip", csv=None,
                               malignant_birads=(4, 5), allow_for_processing=False,
                               test_images="full"):
    """Register the role datasets (lazily loaded) and return {role: registered name}.

    ``fmt``: cbis_ddsm | vindr_mammo | exam_csv. Calling again with the same arguments is a
    no-op; with other arguments under the same names, the old registration is replaced.
    """
    return register(RegistrationSpec.from_args(
        fmt, root, name=name, protocol=protocol, ratio=ratio, seed=seed,
        val_fraction=val_fraction, split_dir=split_dir, on_bad_input=on_bad_input, csv=csv,
        malignant_birads=malignant_birads, allow_for_processing=allow_for_processing,
        test_images=test_images))


def register_from_cfg(cfg):
    """register_braixdet_datasets from cfg.DATASETS.BRAIXDET.*; returns {role: name}."""
    return register(RegistrationSpec.from_cfg(cfg))
