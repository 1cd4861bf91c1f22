"""Training protocols (paper §4.2): patient-wise splits and the labelled subsets D_s / D_w.

Roles, all patient-wise (a patient's images are in one role only):
- ``test``: the detection test set, from the source's test split, by ``test_images``:
  ``"paper"``: the fully annotated CANCER images only (paper §4.1, for ADMANI: "we remove all
  non-cancer cases, and all weakly annotated cancer cases"; applying it to CBIS-DDSM, whose
  benign test images the paper does not say it drops, is our extrapolation); ``"full"``: every
  FULLY ANNOTATED image, lesion-free ones included (they add false positives: FPPI
  denominator); ``"full+negatives"``: also the weak label-0 images as lesion-free. A weak
  cancer (boxes unknown) is never scored.
- ``test_cls``: every image of the test split with its label (stage-1 classifier evaluation).
- ``val``: ``val_fraction`` of the training patients (seeded); their fully annotated images only
  (paper: the validation set has no weakly annotated cases: they cannot select a detector). Their
  weak images are used nowhere, so no patient is in training and validation.
- "partial" protocol, ratio r: the FULLY ANNOTATED SUBSET of the remaining training patients is
  sub-sampled patient-wise with ratio r; the sampled patients' full images form D_s, every other
  full image becomes weak (boxes withheld, label kept) and joins the originally weak ones in D_w.
  The sample is stratified: r of the patients with a full malignant image (at least one) and r
  of the patients whose full images are all lesion-free, so D_s keeps the subset's cancer mix at
  every ratio. Weak copies of full images keep their boxes as ``withheld_annotations``, read only
  to report the quality of pseudo-labels (never by training).
- "full" protocol (the paper's "fully labelled protocol", Tables 3 and 6: "all fully annotated
  data and extra weakly-labelled data"): every full image is D_s, the originally weak ones D_w.
- "supervised_only" protocol (the paper's Table 5, "using only the supervised data"): every full
  image is D_s and D_w is empty; the weak images are used nowhere (not even by stage 1).
- ``train_all`` = D_s ∪ D_w (stage-1 classifier, labels only).

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

from ..utils.io import atomic_write_json

logger = logging.getLogger(__name__)

ROLES = ("train_full", "train_weak", "train_all", "val", "test", "test_cls")
# partial: Tables 2 and 4; full: Tables 3 and 6; supervised_only: Table 5 (module docstring)
PROTOCOLS = ("partial", "full", "supervised_only")
TEST_IMAGES = ("paper", "full", "full+negatives")  # the detection test set (module docstring)


def parse_ratio(ratio):
    """'1/8' | 0.125 | '0.125' -> Fraction(1, 8); must be in (0, 1]."""
    r = Fraction(str(ratio).strip()).limit_denominator(1000)
    if not 0 < r <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
    return r


def ratio_tag(protocol, ratio):
    """'r1_8' for 1/8, 'r3_4', ...; the protocol's name for the two without a ratio."""
    if protocol != "partial":
        return protocol
    r = parse_ratio(ratio)
    return f"r{r.numerator}_{r.denominator}"


def _fingerprint(dicts):
    ids = "\n".join(sorted(f"{d['image_id']}|{d['patient_id']}|{d['split']}|"
                           f"{d['annotation_type']}|{d['label']}" for d in dicts))
    return hashlib.sha256(ids.encode()).hexdigest()[:16]


def _params(dicts, protocol, ratio, seed, val_fraction, test_images):
    return {"protocol": protocol,
            "ratio": "1" if protocol != "partial" else str(parse_ratio(ratio)),
            "seed": int(seed), "val_fraction": float(val_fraction), "test_images": test_images,
            "dataset": _fingerprint(dicts)}


def _sample(patients, fraction, rng_key, at_least_one):
    """Seeded sample of round(fraction * n) patients from a sorted list."""
    patients = sorted(patients)
    n = int(round(float(fraction) * len(patients)))
    if at_least_one and fraction > 0 and patients:
        n = max(n, 1)
    rng = np.random.default_rng(rng_key)
    return set(patients[i] for i in rng.permutation(len(patients))[:n])


def _is_full(d):
    return d["annotation_type"] == "full"


def compute_split(dicts, protocol="partial", ratio="1/8", seed=0, val_fraction=0.1,
                  test_images="full"):
    """Image ids per role (see module doc); pure function of the inputs."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if test_images not in TEST_IMAGES:
        raise ValueError(f"test images must be one of {TEST_IMAGES}, got {test_images!r}")
    r = parse_ratio(ratio) if protocol == "partial" else Fraction(1)
    test_patients = {d["patient_id"] for d in dicts if d["split"] == "test"}
    test_all = [d for d in dicts if d["patient_id"] in test_patients]
    if test_images == "paper":
        test = [d for d in test_all if _is_full(d) and d["label"] == 1]
    else:
        test = [d for d in test_all if _is_full(d)
                or (test_images == "full+negatives" and d["label"] == 0)]
    train = [d for d in dicts if d["patient_id"] not in test_patients]
    train_patients = {d["patient_id"] for d in train}
    # keep >= 1 training patient: val takes at most n - 1
    val_patients = _sample(train_patients, val_fraction, [int(seed), 0],
                           at_least_one=len(train_patients) > 1)
    if len(val_patients) >= len(train_patients) > 0:
        val_patients.discard(max(val_patients))
    val = [d for d in train if d["patient_id"] in val_patients and _is_full(d)]
    train = [d for d in train if d["patient_id"] not in val_patients]

    if protocol == "supervised_only":
        train = [d for d in train if _is_full(d)]
    if protocol != "partial":
        full = [d for d in train if _is_full(d)]
    else:
        annotated = {d["patient_id"] for d in train if _is_full(d)}
        malignant = {d["patient_id"] for d in train if _is_full(d) and d["label"] == 1}
        kept = (_sample(malignant, r, [int(seed), 1], at_least_one=True)
                | _sample(annotated - malignant, r, [int(seed), 2], at_least_one=False))
        full = [d for d in train if _is_full(d) and d["patient_id"] in kept]
    full_ids = {d["image_id"] for d in full}
    weak = [d for d in train if d["image_id"] not in full_ids]
    ids = lambda ds: sorted(d["image_id"] for d in ds)  # noqa: E731
    return {"train_full": ids(full), "train_weak": ids(weak), "train_all": ids(train),
            "val": ids(val), "test": ids(test), "test_cls": ids(test_all)}


def saved_split_ids(split_file, protocol="partial", ratio="1/8", seed=0, val_fraction=0.1,
                    test_images="full"):
    """{role: image ids} of ``split_file`` when it was written with these parameters (by an
    earlier ``split_dataset``), without reading the dataset; None otherwise. Whether the dataset
    is still the one it was computed on (its fingerprint) is not checked: that needs its image
    list, which is what this avoids loading."""
    try:
        with open(split_file) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    want = _params([], protocol, ratio, seed, val_fraction, test_images)
    got = dict(saved.get("params") or {})
    if {k: v for k, v in got.items() if k != "dataset"} != \
            {k: v for k, v in want.items() if k != "dataset"}:
        return None
    return {k: saved[k] for k in ROLES if k in saved}


def split_dataset(dicts, protocol="partial", ratio="1/8", seed=0, val_fraction=0.1,
                  split_file=None, test_images="full"):
    """Dataset dicts per role (``ROLES``, see the module docstring).

    ``train_weak`` dicts (and the converted images inside ``train_all``) are copies with
    ``annotation_type="weak"``, no ``annotations`` and the boxes in ``withheld_annotations``.
    When ``split_file`` exists with the same parameters and dataset fingerprint it is reused;
    otherwise the split is computed and written.
    """
    params = _params(dicts, protocol, ratio, seed, val_fraction, test_images)
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
        split = compute_split(dicts, protocol, ratio, seed, val_fraction, test_images)
        if split_file:
            atomic_write_json(split_file, {"params": params, **split}, indent=1)

    by_id = {d["image_id"]: d for d in dicts}
    weak_ids = set(split["train_weak"])

    def make(image_id):
        d = copy.deepcopy(by_id[image_id])
        if image_id in weak_ids and d["annotation_type"] != "weak":
            d["annotation_type"] = "weak"
            d["withheld_annotations"] = d.pop("annotations", [])
        return d

    out = {role: [make(i) for i in split[role] if i in by_id] for role in ROLES}
    logger.info("Split (%s, ratio %s, seed %d): %s", protocol, params["ratio"], seed,
                ", ".join(f"{k}={len(v)} ({sum(d['label'] for d in v)} malignant)"
                          for k, v in out.items()))
    return out
