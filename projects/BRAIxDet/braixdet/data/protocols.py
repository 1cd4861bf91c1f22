"""Training protocols (paper §4.2, DESIGN §2.4): patient-wise train/val split and D_s / D_w.

- test: the source's test split (a patient with any test image is a test patient entirely);
- val: ``val_fraction`` of the train patients (seeded), images kept as they are;
- "partial" protocol, ratio r: among the remaining train patients that have a fully annotated
  malignant image, a fraction r of the PATIENTS is sampled; their full images form D_s. The
  malignant full images of the other patients become weak (boxes withheld, label kept) -> D_w,
  as do the originally weak ones. **(choice)** Full images with label 0 stay full (they are fully
  annotated: no lesion to withhold), so D_s = sampled patients' full images + every lesion-free
  full image, and the ratio is over the malignant annotated subset, as in the paper's counts.
- "full" protocol: every full image is D_s, the originally weak ones D_w.
- train_all = D_s ∪ D_w (every non-val train image with its label; stage-1 classifier).

Determinism: numpy Generators seeded with (seed, purpose) over SORTED patient ids; no Python hash.
The split is saved as JSON (image ids per role + parameters) and reused when the parameters and
the dataset's image ids are unchanged.
"""
import copy
import hashlib
import json
import logging
import os
from fractions import Fraction

import numpy as np

logger = logging.getLogger(__name__)

ROLES = ("train_full", "train_weak", "train_all", "val", "test")
PROTOCOLS = ("partial", "full")


def parse_ratio(ratio):
    """'1/8' | 0.125 | '0.125' -> Fraction(1, 8); must be in (0, 1]."""
    r = Fraction(str(ratio).strip()).limit_denominator(1000)
    if not 0 < r <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
    return r


def ratio_tag(protocol, ratio):
    """'r1_8' for 1/8, 'r3_4', ...; 'full' for the fully labelled protocol."""
    if protocol == "full":
        return "full"
    r = parse_ratio(ratio)
    return f"r{r.numerator}_{r.denominator}"


def _fingerprint(dicts):
    ids = "\n".join(sorted(f"{d['image_id']}|{d['patient_id']}|{d['split']}|"
                           f"{d['annotation_type']}|{d['label']}" for d in dicts))
    return hashlib.sha256(ids.encode()).hexdigest()[:16]


def _params(dicts, protocol, ratio, seed, val_fraction):
    return {"protocol": protocol,
            "ratio": "1" if protocol == "full" else str(parse_ratio(ratio)),
            "seed": int(seed), "val_fraction": float(val_fraction),
            "dataset": _fingerprint(dicts)}


def _sample(patients, fraction, rng_key, at_least_one):
    """Seeded sample of round(fraction * n) patients from a sorted list."""
    patients = sorted(patients)
    n = int(round(float(fraction) * len(patients)))
    if at_least_one and fraction > 0 and patients:
        n = max(n, 1)
    rng = np.random.default_rng(rng_key)
    return set(patients[i] for i in rng.permutation(len(patients))[:n])


def compute_split(dicts, protocol="partial", ratio="1/8", seed=0, val_fraction=0.1):
    """Image ids per role (see module doc); pure function of the inputs."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    r = parse_ratio(ratio) if protocol == "partial" else Fraction(1)
    test_patients = {d["patient_id"] for d in dicts if d["split"] == "test"}
    test = [d for d in dicts if d["patient_id"] in test_patients]
    train = [d for d in dicts if d["patient_id"] not in test_patients]
    train_patients = {d["patient_id"] for d in train}
    # keep >= 1 training patient: val takes at most n - 1
    val_patients = _sample(train_patients, val_fraction, [int(seed), 0],
                           at_least_one=len(train_patients) > 1)
    if len(val_patients) >= len(train_patients) > 0:
        val_patients.discard(max(val_patients))
    val = [d for d in train if d["patient_id"] in val_patients]
    train = [d for d in train if d["patient_id"] not in val_patients]

    if protocol == "full":
        full = [d for d in train if d["annotation_type"] == "full"]
    else:
        annotated = {d["patient_id"] for d in train
                     if d["annotation_type"] == "full" and d["label"] == 1}
        kept = _sample(annotated, r, [int(seed), 1], at_least_one=True)
        full = [d for d in train if d["annotation_type"] == "full"
                and (d["label"] == 0 or d["patient_id"] in kept)]
    full_ids = {d["image_id"] for d in full}
    weak = [d for d in train if d["image_id"] not in full_ids]
    ids = lambda ds: sorted(d["image_id"] for d in ds)  # noqa: E731
    return {"train_full": ids(full), "train_weak": ids(weak), "train_all": ids(train),
            "val": ids(val), "test": ids(test)}


def split_dataset(dicts, protocol="partial", ratio="1/8", seed=0, val_fraction=0.1,
                  split_file=None):
    """Dataset dicts per role: {"train_full", "train_weak", "train_all", "val", "test"}.

    ``train_weak`` dicts (and the converted images inside ``train_all``) are copies with
    ``annotation_type="weak"`` and no ``annotations``. When ``split_file`` exists with the same
    parameters and dataset fingerprint it is reused; otherwise the split is computed and written.
    """
    params = _params(dicts, protocol, ratio, seed, val_fraction)
    split = None
    if split_file and os.path.isfile(split_file):
        with open(split_file) as f:
            saved = json.load(f)
        if saved.get("params") == params:
            split = {k: saved[k] for k in ROLES}
            logger.info("Reusing split %s", split_file)
        else:
            logger.warning("Split %s has other parameters or another dataset; recomputing",
                           split_file)
    if split is None:
        split = compute_split(dicts, protocol, ratio, seed, val_fraction)
        if split_file:
            os.makedirs(os.path.dirname(os.path.abspath(split_file)), exist_ok=True)
            tmp = f"{split_file}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({"params": params, **split}, f, indent=1)
            os.replace(tmp, split_file)

    by_id = {d["image_id"]: d for d in dicts}
    weak_ids = set(split["train_weak"])

    def make(image_id):
        d = copy.deepcopy(by_id[image_id])
        if image_id in weak_ids and d["annotation_type"] != "weak":
            d["annotation_type"] = "weak"
            d.pop("annotations", None)
        return d

    out = {role: [make(i) for i in split[role] if i in by_id] for role in ROLES}
    logger.info("Split (%s, ratio %s, seed %d): %s", protocol, params["ratio"], seed,
                ", ".join(f"{k}={len(v)}" for k, v in out.items()))
    return out
