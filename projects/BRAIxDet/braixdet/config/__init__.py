"""BRAIxDet's config, built and checked in one place: the keys (defaults.py), every check of
their values (checks.py), building a run's config and resolving what its data decides
(build.py), and the schedule in epochs (schedule.py)."""
from .build import build_cfg, inference_cfg, ratio_string, register_datasets, resolve_cfg
from .checks import ConfigValueError, check_config, check_module_keys
from .defaults import UNSUPPORTED_KEYS, add_braixdet_config
from .schedule import has_weak_images, resolve_schedule, validation_metric

__all__ = ["add_braixdet_config", "build_cfg", "resolve_cfg", "register_datasets",
           "inference_cfg", "ratio_string", "check_config", "check_module_keys",
           "ConfigValueError", "UNSUPPORTED_KEYS", "resolve_schedule", "has_weak_images",
           "validation_metric"]
