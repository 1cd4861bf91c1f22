"""Small helpers shared across the package (file names from untrusted values, ...)."""
from .paths import safe_file_name, safe_output_path

__all__ = ["safe_file_name", "safe_output_path"]
