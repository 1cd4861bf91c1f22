"""Output file names derived from input data (DICOM UIDs, CSV cells) that cannot leave their folder.

A DICOM's SOPInstanceUID or a CSV's image id is attacker-controlled: ``/tmp/x``, ``../../x``, a NUL
or a 10 kB string must never become a path outside the output folder. Names are reduced to a safe
alphabet; when that changes the value (or it is too long) a hash of the original is appended, so
two different values never share a file.
"""
import hashlib
import os
import re

from .io import OutputPathRefused, refuse_link

__all__ = ["safe_file_name", "safe_output_path"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
MAX_STEM = 120


def safe_file_name(value, suffix: str = "") -> str:
    """A file name (no separators, no leading dot, bounded length) for an untrusted ``value``."""
    raw = str(value)
    stem = _UNSAFE.sub("_", raw).lstrip("._-")[:MAX_STEM]
    if stem != raw or not stem:
        digest = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:12]
        stem = f"{stem}_{digest}" if stem else digest
    return stem + suffix


def safe_output_path(out_dir, value, suffix: str = "") -> str:
    """``out_dir/<safe_file_name(value)>``; ``OutputPathRefused`` (a ValueError) when that is a
    symbolic link (e.g. planted in the output folder) or resolves outside ``out_dir``."""
    root = os.path.realpath(out_dir)
    path = os.path.join(root, safe_file_name(value, suffix))
    refuse_link(path)
    if os.path.dirname(os.path.realpath(path)) != root:
        raise OutputPathRefused(path, f"outside the output folder {root}")
    return path
