#!/usr/bin/env python
"""Algorithm 1: GradCAM pseudo-boxes of the BRAIxMVCCL classifier for weakly labelled cancers;
usage and outputs: ``braixdet/pipeline/gradcam_pseudo_labels.py`` (``--help``)."""
import sys

from braixdet.cli import run_tool
from braixdet.pipeline.gradcam_pseudo_labels import main, parse_args  # noqa: F401

if __name__ == "__main__":
    sys.exit(run_tool(main))
