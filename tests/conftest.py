"""Shared pytest fixtures: one tiny synthetic CBIS-DDSM-style dataset per test session."""
import os
import types

# Nothing downloads during tests: timm/huggingface_hub fail fast instead of retrying the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

try:  # the machine is shared: keep torch's intra-op pool small
    import torch

    torch.set_num_threads(1)  # steady timings on a shared 2-core machine
except ImportError:  # pragma: no cover
    pass

from synthetic_mammo import make_synthetic_dataset

SYNTH_KW = dict(patients=10, image_size=(128, 96), lesion_rate=0.7, seed=0)


@pytest.fixture(scope="session")
def synthetic_root(tmp_path_factory):
    """Tiny dataset generated once: ``.root`` (dataset root path), ``.summary`` (returned dict).

    Guaranteed: train split has >= 4 malignant images, test split >= 2.
    """
    root = tmp_path_factory.mktemp("synthetic") / "cbis"
    summary = make_synthetic_dataset(str(root), progress=False, **SYNTH_KW)
    splits = summary["splits"]
    assert splits["train"]["malignant_images"] >= 4, splits
    assert splits["test"]["malignant_images"] >= 2, splits
    return types.SimpleNamespace(root=str(root), summary=summary)


@pytest.fixture(autouse=True)
def braixdet_logs_reach_caplog():
    """Tools run in-process call detectron2's setup_logger(name="braixdet"), which stops the
    package's records from propagating to the root logger, where pytest's caplog listens."""
    import logging

    yield
    logging.getLogger("braixdet").propagate = True
