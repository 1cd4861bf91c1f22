"""Shared helpers of the benchmarks: threads/environment line, tiny configs, synthetic data,
interleaved timing and markdown tables.

Benchmarks are run as scripts (``python benchmarks/benchmark_x.py``), so this module is imported
as ``_common`` (the script's folder is on ``sys.path``).
"""
import os
import platform
import statistics
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "configs")

# Keys of the demo/paper configs that point at stage-1 outputs: a benchmark starts from a random
# init, so they are cleared (the timing does not depend on the weights).
_NO_STAGE1 = ("MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", "", "MODEL.WEIGHTS", "",
              "SSL.CAM_JSON", "", "SSL.USE_CAM", "False")


_START_LOAD = None


def set_threads():
    """torch threads from $BENCH_THREADS (default 2: the benchmark machine's core count).
    Also records the load average before the benchmark's own work (for env_line)."""
    global _START_LOAD
    _START_LOAD = load_average()
    n = int(os.environ.get("BENCH_THREADS", 2))
    torch.set_num_threads(n)
    return n


def load_average():
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def env_line():
    la, la0 = load_average(), _START_LOAD or load_average()
    line = (f"torch {torch.__version__}, threads {torch.get_num_threads()}, {cpu_model()} "
            f"({os.cpu_count()} cores), python {platform.python_version()}, "
            f"load average (1/5/15 min) at start {la0[0]:.2f} {la0[1]:.2f} {la0[2]:.2f}, "
            f"at end {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")
    if la0[0] >= 1.0:
        # other processes compete for the cores: OpenMP threads then stall each other at
        # barriers (step times vary several-fold with 2 threads on 2 busy cores); the paired
        # per-round ratios stay usable, absolute times do not
        line += (" — machine SHARED (other load at start); compare paired ratios, not times; "
                 "BENCH_THREADS=1 gives steadier times")
    return line


def config_path(rel):
    """A config path given relative to configs/ (or absolute / relative to the cwd)."""
    if os.path.isfile(rel):
        return os.path.abspath(rel)
    return os.path.join(CONFIGS, rel)


def build_cfg(config="demo/BRAIxDet/braixdet.yaml", opts=(), output_dir=None):
    """braixdet.engine.setup.build_cfg with stage-1 inputs cleared and OUTPUT_DIR set."""
    from braixdet.engine.setup import build_cfg as _build

    opts = list(_NO_STAGE1) + list(opts)
    if output_dir:
        opts += ["OUTPUT_DIR", output_dir]
    return _build(config_path(config), opts)


def size_opts(size):
    """Config opts setting the canonical size (H, W)."""
    return ["INPUT.BRAIXDET.CANONICAL_SIZE", f"({int(size[0])}, {int(size[1])})"]


def make_dataset(root, patients=12, image_size=(512, 320), seed=0):
    """Synthetic CBIS-DDSM-layout dataset under ``root`` (deterministic); returns its summary."""
    from synthetic_mammo import make_synthetic_dataset

    return make_synthetic_dataset(root, patients=patients, image_size=tuple(image_size),
                                  seed=seed, progress=False)


def fake_input(size, full=True, label=1, seed=0, image_id="img", n_boxes=1):
    """One mapper-like dict (see MultiViewDatasetMapper) with random pixels and, for a full
    image, ``n_boxes`` lesion boxes in canonical coordinates."""
    from detectron2.data.transforms import TransformList
    from detectron2.structures import Boxes, Instances

    h, w = int(size[0]), int(size[1])
    g = torch.Generator().manual_seed(seed)
    d = {"image": torch.rand(1, h, w, generator=g), "aux_image": torch.rand(1, h, w, generator=g),
         "label": int(label), "annotation_type": "full" if full else "weak",
         "image_id": f"{image_id}{seed}", "height": h, "width": w,
         "transforms": TransformList([]), "aug_transforms": TransformList([])}
    if full:
        inst = Instances((h, w))
        boxes = []
        for k in range(n_boxes if label else 0):
            cy, cx = (0.3 + 0.4 * torch.rand(2, generator=g)).tolist()
            bh, bw = h * 0.06 * (1 + k % 2), w * 0.1
            boxes.append([cx * w - bw / 2, cy * h - bh / 2, cx * w + bw / 2, cy * h + bh / 2])
        inst.gt_boxes = Boxes(torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4))
        inst.gt_classes = torch.zeros(len(boxes), dtype=torch.int64)
        d["instances"] = inst
    return d


class CyclingLoader:
    """In-memory loader: an infinite iterator over fixed batches (lists of dicts). Each batch is
    shallow-copied per draw, as a real loader yields fresh dicts."""

    def __init__(self, batches):
        self.batches, self.k = list(batches), 0

    def __iter__(self):
        return self

    def __next__(self):
        b = self.batches[self.k % len(self.batches)]
        self.k += 1
        return [dict(x) for x in b]


def timeit(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def interleaved(fns, repeats, warmup=1):
    """Time each callable of ``fns`` (name -> fn) ``repeats`` times, alternating the variants
    (A B A B ...; the order is rotated each round so no variant always runs after the same
    one) after ``warmup`` untimed rounds. Returns name -> list of seconds."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    out = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            out[n].append(timeit(fns[n]))
    return out


def paired_ratios(times, num, den):
    """Per-round ratios num[r] / den[r] of ``interleaved`` samples (adjacent in time, so a
    load change hits both): their median is robust to the machine's load drifting."""
    return [a / b for a, b in zip(times[num], times[den])]


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def iqr(xs):
    """(q1, q3) of the samples (whole range below 4 samples)."""
    xs = sorted(xs)
    if len(xs) < 4:
        return (xs[0], xs[-1]) if xs else (float("nan"),) * 2
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def ms(x):
    return f"{1000.0 * x:.1f}"


def md_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def emit(title, text, out=None):
    """Print the report (title, environment line, tables) and optionally write it to ``out``."""
    report = f"## {title}\n\n{env_line()}\n\n{text}\n"
    print(report)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
        with open(out, "w") as f:
            f.write(report)
    return report


def verdict(value, target, higher_is_worse=True):
    ok = value <= target if higher_is_worse else value >= target
    return "PASS" if ok else "MISS"
