"""Shared pytest fixtures: one tiny synthetic CBIS-DDSM-style dataset per test session, and the
scripts of tools/ as modules (``load_tool``)."""
import importlib.util
import os
import sys
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


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def load_tool():
    """``load_tool("predict")``: the module of tools/predict.py, imported once per session
    (``folder="benchmarks"``: a script of benchmarks/ that imports no sibling).

    The tools are scripts, not a package (and another distribution installs a package named
    ``tools``), so each is imported from its file as the module ``<folder>_<name>``, registered
    in sys.modules like any import (a worker pool pickles its functions by module name)."""
    def load(name, folder="tools"):
        module_name = f"{folder}_{name}"
        if module_name not in sys.modules:
            spec = importlib.util.spec_from_file_location(
                module_name, os.path.join(REPO, folder, f"{name}.py"))
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]
                raise
        return sys.modules[module_name]
    return load


@pytest.fixture(autouse=True)
def braixdet_logs_reach_caplog():
    """Tools run in-process call detectron2's setup_logger(name="braixdet"), which stops the
    package's records from propagating to the root logger, where pytest's caplog listens."""
    import logging

    yield
    logging.getLogger("braixdet").propagate = True
