"""Named generator settings: benchmark regimes in the paper's difficulty, apart from the demo's.

Each regime is keyword arguments of ``make_synthetic_dataset`` (its own generator seed and size
mix, so that nothing is tuned to one draw): lesion contrast near visibility, a 1/f^3 anatomical
texture, crossing vessels with vascular calcifications and extra benign findings as look-alikes,
and log-normal (CBIS-like) lesion sizes. Chosen on the Faster R-CNN rows only, by criteria
written down before any semi-supervised run (docs/RESULTS.md §10, where every tried setting and
its numbers are listed). ``benchmarks/experiment_benchmark_regime.py`` generates one and runs
those rows.
"""
import inspect

from .write import make_synthetic_dataset

_HARD = dict(image_size=(512, 256), lesion_rate=0.7, malignant_fraction=0.5, separation=1.5,
             texture_beta=3.0, texture_strength=0.05, contrast_scale=0.6, vessels=2.0,
             vessel_calc_fraction=0.3, benign_per_breast=0.6)

REGIMES = {
    "benchmark_a": dict(_HARD, seed=27, patients=600, size_scale=0.8, size_sigma=0.45),
    "benchmark_b": dict(_HARD, seed=2701, patients=600, size_scale=0.7, size_sigma=0.6),
}


def regime(name, **overrides):
    """The settings of regime ``name`` with ``overrides`` applied (keys of
    make_synthetic_dataset); a clear error for an unknown name or key."""
    if name not in REGIMES:
        raise ValueError(f"unknown regime {name!r}; known: {', '.join(sorted(REGIMES))}")
    known = set(inspect.signature(make_synthetic_dataset).parameters)
    bad = sorted(set(overrides) - known)
    if bad:
        raise ValueError(f"not a make_synthetic_dataset setting: {', '.join(bad)}")
    return dict(REGIMES[name], **overrides)
