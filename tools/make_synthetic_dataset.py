#!/usr/bin/env python
"""Writes a synthetic CBIS-DDSM-style mammography dataset (plus exams.csv) for demos and tests.

    python tools/make_synthetic_dataset.py --out datasets/synthetic --patients 40 --seed 0
"""
import argparse
import json
import sys

from synthetic_mammo import make_synthetic_dataset

from braixdet.cli import run_tool


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="dataset root to create")
    p.add_argument("--patients", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", type=int, default=512, help="original mammogram height")
    p.add_argument("--cols", type=int, default=320, help="original mammogram width")
    p.add_argument("--lesion-rate", type=float, default=0.6, help="P(breast has lesions)")
    p.add_argument("--malignant-fraction", type=float, default=0.5)
    p.add_argument("--test-fraction", type=float, default=0.25)
    p.add_argument("--truth", default=None, help="optional JSON ground truth (outside --out)")
    args = p.parse_args(argv)
    s = make_synthetic_dataset(
        args.out, patients=args.patients, image_size=(args.rows, args.cols),
        lesion_rate=args.lesion_rate, malignant_fraction=args.malignant_fraction,
        test_fraction=args.test_fraction, seed=args.seed, progress=True, truth_path=args.truth,
    )
    s.pop("truth")
    print(json.dumps(s, indent=1))


if __name__ == "__main__":
    sys.exit(run_tool(main))
