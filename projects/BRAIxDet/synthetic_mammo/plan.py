"""What the synthetic dataset contains, before any pixel: patients, splits, lesions and places.

Every function draws from the ``rng`` it is given, in a fixed order, so the same seed gives the
same plan (write.py gives each stage its own seeded generator).
"""
from statistics import NormalDist

import numpy as np

VIEWS = ("CC", "MLO")


def plan_patients(rng, patients, lesion_rate, malignant_fraction, test_fraction):
    """Patient ids, splits and which breasts carry (malignant) lesions."""
    ids, pid = [], 0
    for _ in range(patients):
        pid += int(rng.integers(1, 4))  # sparse ids, like upstream
        ids.append(f"P_{pid:05d}")
    n_test = int(round(patients * test_fraction))
    if patients >= 2 and test_fraction > 0:
        n_test = min(max(n_test, 1), patients - 1)
    test_idx = set(rng.permutation(patients)[:n_test].tolist())
    plan = []
    for i, p in enumerate(ids):
        split = "test" if i in test_idx else "train"
        breasts = {}
        for lat in ("L", "R"):
            has = rng.uniform() < lesion_rate
            breasts[lat] = {
                "has_lesion": bool(has),
                "n": int(rng.choice([1, 1, 1, 2])) if has else 0,
                "malignant": [bool(rng.uniform() < malignant_fraction) for _ in range(2)],
                "kind": "mass" if rng.uniform() < 0.55 else "calc",
            }
        plan.append({"index": i, "patient": p, "split": split, "breasts": breasts})
    # Guarantee at least one malignant breast per non-empty split (tests/demo need positives).
    for split in ("train", "test"):
        members = [pl for pl in plan if pl["split"] == split]
        if malignant_fraction > 0 and lesion_rate > 0 and members and not any(
            b["has_lesion"] and any(b["malignant"][: b["n"]])
            for pl in members for b in pl["breasts"].values()
        ):
            b = members[0]["breasts"]["L"]
            b.update(has_lesion=True, n=max(1, b["n"]))
            b["malignant"][0] = True
    return plan


def breast_geometry(rng, rows, cols):
    """Per-breast geometry shared by both views (same depth axis => consistent lesion depth)."""
    return {
        "a": float(rng.uniform(0.62, 0.76) * cols),  # chest wall -> nipple distance (px)
        "cc_b": float(rng.uniform(0.36, 0.43) * rows),
        "cc_cy": float(rng.uniform(0.47, 0.53) * rows),
        "mlo_b": float(rng.uniform(0.50, 0.56) * rows),
        "mlo_cy": float(rng.uniform(0.50, 0.56) * rows),
        "pect_w": float(rng.uniform(0.22, 0.36) * cols),
        "pect_h": float(rng.uniform(0.35, 0.50) * rows),
    }


def _resize(frac, lo, hi, size_scale, size_spread, size_sigma=0.0):
    """Map a diameter fraction drawn from U(lo, hi): scale around the range's centre, then
    stretch its deviation by ``size_spread`` (our choice, for development sets that are not the
    demo's). The defaults (1, 1) return ``frac`` unchanged, so the demo's data stay identical.

    ``size_sigma`` > 0 instead maps the same draw to a log-normal diameter (median: the range's
    centre times ``size_scale``, log-std ``size_sigma``): the long-tailed spread of CBIS-DDSM's
    lesion sizes (many small, a few very large), via the normal quantile of the draw's position.
    """
    centre = (lo + hi) / 2
    if size_sigma > 0:
        q = min(max((frac - lo) / (hi - lo), 1e-4), 1 - 1e-4)
        return max(0.01, size_scale * centre * float(np.exp(size_sigma * NormalDist().inv_cdf(q))))
    if size_scale == 1.0 and size_spread == 1.0:
        return frac
    return max(0.01, size_scale * (centre + size_spread * (frac - centre)))


def sample_lesion(rng, kind, malignant, cols, separation=1.0, size_scale=1.0, size_spread=1.0,
                  size_sigma=0.0, contrast_scale=1.0):
    """Lesion parameters; malignant vs benign differ in distribution, with overlap.

    ``separation`` >= 1 pulls the two distributions apart (more spiculated, higher-contrast
    malignant masses, fewer spiculated benign ones, brighter malignant calcifications); 1 is the
    original overlap. ``size_scale`` / ``size_spread`` / ``size_sigma`` change the lesion
    diameters (see _resize); ``contrast_scale`` multiplies the contrast (< 1: near visibility).
    Same random draws whatever their values.
    """
    s = float(separation)
    if kind == "mass":
        spiculated = rng.uniform() < (1 - 0.3 / s if malignant else 0.2 / s)
        diam = _resize(rng.uniform(0.06, 0.11), 0.06, 0.11, size_scale, size_spread,
                       size_sigma) * cols
        les = {
            "type": "mass",
            "radius": diam / 2,
            "irregularity": float(rng.uniform(min(0.10 * s, 0.3), 0.35) if malignant
                                  else rng.uniform(0, 0.2)),
            "spikes": int(rng.integers(5, 11)) if spiculated else 0,
            "blur": float(rng.uniform(0.4, 1.2) if spiculated else rng.uniform(0.5, 2.0)),
            "contrast": float(np.clip(rng.normal(0.14 + 0.04 * s if malignant else 0.14, 0.05),
                                      0.07, 0.35)),
        }
        irregular = les["irregularity"] > 0.2
        les["shape"] = ("IRREGULAR" if irregular else
                        str(rng.choice(["ROUND", "OVAL", "LOBULATED"])))
        les["margins"] = ("SPICULATED" if spiculated else
                          str(rng.choice(["CIRCUMSCRIBED", "OBSCURED", "ILL_DEFINED",
                                          "MICROLOBULATED"])))
        les["extent"] = les["radius"] * (1.8 if spiculated else 1 + les["irregularity"])
        if contrast_scale != 1.0:
            les["contrast"] *= contrast_scale
        return les
    diam = _resize(rng.uniform(0.07, 0.13), 0.07, 0.13, size_scale, size_spread,
                   size_sigma) * cols
    les = {
        "type": "calc",
        "radius": diam / 2,
        "n_dots": int(rng.integers(8, 16) if malignant else rng.integers(4, 10)),
        "tightness": float(rng.uniform(0.3, 0.5) if malignant else rng.uniform(0.45, 0.7)),
        "pleomorphism": float(rng.uniform(0.5, 1.0) if malignant else rng.uniform(0.0, 0.6)),
        "contrast": float(np.clip(rng.normal(0.36 + 0.06 * s if malignant else 0.36, 0.06),
                                  0.2, 0.6)),
    }
    les["calc_type"] = ("PLEOMORPHIC" if les["pleomorphism"] > 0.55 else
                        str(rng.choice(["PUNCTATE", "ROUND_AND_REGULAR", "AMORPHOUS"])))
    les["distribution"] = "CLUSTERED" if les["tightness"] < 0.5 else str(
        rng.choice(["CLUSTERED", "SEGMENTAL", "REGIONAL"]))
    les["extent"] = les["radius"] + max(1.0, 0.01 * cols) + 2
    if contrast_scale != 1.0:
        les["contrast"] *= contrast_scale
    return les


def _view_y(rng, geo, view, x):
    """A vertical position in ``view`` at distance ``x`` from the chest wall (left frame),
    within 0.65 of the breast's half-height there."""
    a = geo["a"]
    b, cy = (geo["cc_b"], geo["cc_cy"]) if view == "CC" else (geo["mlo_b"], geo["mlo_cy"])
    half = b * np.sqrt(max(0.0, 1 - (x / a) ** 2))
    return cy + rng.uniform(-0.65, 0.65) * half


def _fits(x, y, ext, view, allowed, placed, rows, cols):
    """Whether a finding of extent ``ext`` centred at (x, y) of ``view`` lies ``ext`` + 2 inside
    ``allowed[view]`` and clear of every ``placed`` one there."""
    xi, yi = int(round(x)), int(round(y))
    if not (0 <= yi < rows and 0 <= xi < cols) or allowed[view][yi, xi] < ext + 2:
        return False
    return not any(np.hypot(x - p["_xy"][view][0], y - p["_xy"][view][1])
                   < ext + p["extent"] + 3 for p in placed)


def place_lesions(rng, lesions, geo, allowed, rows, cols, occupied=()):
    """Chooses, per lesion, one depth from the nipple and one vertical position per view.

    ``allowed[view]`` is the distance map (left frame) of breast minus pectoral muscle; the
    centre must be ``extent + margin`` inside it in BOTH views, and lesions must not overlap
    each other nor the already placed ``occupied`` ones. Returns the placed ones of ``lesions``.
    """
    a = geo["a"]
    placed = list(occupied)
    for les in lesions:
        for attempt in range(400):
            shrink = 1.0 if attempt < 300 else 0.7
            ext = les["extent"] * shrink
            depth = rng.uniform(0.2, 0.75) * a
            x = a - depth
            cs = {}
            for view in VIEWS:
                y = _view_y(rng, geo, view, x)
                if not _fits(x, y, ext, view, allowed, placed, rows, cols):
                    break
                cs[view] = (float(x), float(y))
            if len(cs) == 2:
                if shrink != 1.0:
                    les["radius"] *= shrink
                    les["extent"] = ext
                les["_xy"], les["depth"] = cs, float(depth)
                placed.append(les)
                break
    return placed[len(occupied):]


def label_lesions(rng, lesions, malignant):
    """Ids, pathology, BI-RADS assessment and subtlety of a breast's placed lesions (in place).

    Returns (cancer, annotation level) of the breast, shared by both its views: a cancer breast
    is "full" (malignant boxes given) for ~1/3, else "weak" (image label only); others "full".
    """
    for k, les in enumerate(lesions):
        les["id"] = k + 1
        mal = malignant[k]
        les["pathology"] = "MALIGNANT" if mal else str(
            rng.choice(["BENIGN", "BENIGN", "BENIGN_WITHOUT_CALLBACK"]))
        les["assessment"] = int(rng.choice([4, 4, 5]) if mal else rng.choice([2, 3, 4]))
        les["subtlety"] = int(rng.integers(1, 6))
    cancer = any(les["pathology"] == "MALIGNANT" for les in lesions)
    annotation = "full" if (not cancer or rng.uniform() < 1 / 3) else "weak"
    return cancer, annotation


def benign_findings(rng, mean, cols, **size):
    """Extra benign masses / calcification clusters of one breast (Poisson count, mean
    ``mean``): look-alikes that a detector must not box. Drawn from their own ``rng`` so the
    breast's planned lesions stay the same; ``size``: sample_lesion's size/contrast keywords."""
    return [sample_lesion(rng, "mass" if rng.uniform() < 0.5 else "calc", False, cols, **size)
            for _ in range(int(rng.poisson(mean)))]


def label_benign(rng, lesions, first_id):
    """Ids, pathology, assessment and subtlety of extra benign findings (in place); marks them
    ``_extra`` (render.render_view draws their pixels from the options' generator)."""
    for k, les in enumerate(lesions):
        les["id"], les["_extra"] = first_id + k, True
        les["pathology"] = str(rng.choice(["BENIGN", "BENIGN_WITHOUT_CALLBACK"]))
        les["assessment"] = int(rng.choice([2, 3]))
        les["subtlety"] = int(rng.integers(1, 6))


def summation_lookalikes(rng, mean, view, geo, allowed, lesions, rows, cols, **size):
    """Tissue-superposition look-alikes of one view (Poisson count, mean ``mean``): densities
    drawn like malignant masses, at a lesion's depth, that appear in ``view`` only. In real
    films overlapping normal tissue mimics a mass in one projection and resolves in the other,
    which only the second view can tell; they are not findings (no truth entry). Placed inside
    ``allowed[view]`` and clear of the breast's ``lesions`` there; each gets ``_xy = {view: ..}``.
    """
    a = geo["a"]
    placed = []
    for _ in range(int(rng.poisson(mean))):
        les = sample_lesion(rng, "mass", True, cols, **size)
        for _attempt in range(100):
            x = a - rng.uniform(0.2, 0.75) * a
            y = _view_y(rng, geo, view, x)
            if not _fits(x, y, les["extent"], view, allowed, lesions + placed, rows, cols):
                continue
            les["_xy"] = {view: (float(x), float(y))}
            placed.append(les)
            break
    return placed
