"""Shared pytest fixtures: one tiny synthetic CBIS-DDSM-style dataset per test session, and the
scripts of tools/ as modules (``load_tool``)."""
import ast
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


def _exec_file(module_name, path):
    """Import the file ``path`` as ``module_name`` (registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _sibling_imports(path):
    """Top-level names ``path`` imports that are scripts beside it (``import _common``)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module}
    folder = os.path.dirname(path)
    return sorted(n for n in names if os.path.isfile(os.path.join(folder, n + ".py")))


@pytest.fixture(scope="session")
def load_tool():
    """``load_tool("predict")``: the module of tools/predict.py, imported once per session;
    ``folder="benchmarks"`` for a benchmark or experiment script.

    The tools are scripts, not a package (and another distribution installs a package named
    ``tools``), so each is imported from its file as the module ``<folder>_<name>``, registered
    in sys.modules like any import (a worker pool pickles its functions by module name). A
    script's imports of its siblings (the benchmarks' ``import _common``, resolved from the
    script's folder when it runs as a script) are imported first under their own names."""
    def load_siblings(path):
        for sibling in _sibling_imports(path):
            if sibling not in sys.modules:
                sibling_path = os.path.join(os.path.dirname(path), sibling + ".py")
                load_siblings(sibling_path)
                _exec_file(sibling, sibling_path)

    def load(name, folder="tools"):
        module_name = f"{folder}_{name}"
        if module_name not in sys.modules:
            path = os.path.join(REPO, folder, f"{name}.py")
            load_siblings(path)
            _exec_file(module_name, path)
        return sys.modules[module_name]
    return load


@pytest.fixture(autouse=True)
def braixdet_logs_reach_caplog():
    """Tools run in-process call detectron2's setup_logger(name="braixdet"), which stops the
    package's records from propagating to the root logger, where pytest's caplog listens."""
    import logging

    yield
    logging.getLogger("braixdet").propagate = True
