"""Shared helpers of the benchmarks: threads/environment line, tiny configs, synthetic data,
device / AMP / peak-memory handling, synchronised interleaved timing and markdown tables.

Every model benchmark takes ``--device`` (default ``cuda`` when available, else ``cpu``),
``--amp`` / ``--compare-amp`` (``add_device_args``); ``parse_args`` validates the device and stores
it, normalised, on ``args.device``. The helpers take that device as an argument (no module state:
a helper cannot silently use another device than the one it is given): ``timeit`` (and so
``interleaved``) synchronises it before reading the clock, ``measure_peak`` reads the peak memory
of one call (CUDA: ``max_memory_allocated`` after ``reset_peak_memory_stats``; CPU: n/a per
variant, the process's peak RSS is reported instead).

Benchmarks are run as scripts (``python benchmarks/benchmark_x.py``), so this module is imported
as ``_common`` (the script's folder is on ``sys.path``).
"""
import argparse
import contextlib
import io
import os
import platform
import resource
import statistics
import sys
import textwrap
import time

import torch

from braixdet.engine.trainers import Precision
from braixdet.pipeline.methods import METHODS
from braixdet.pipeline.results import CEILING, row_metric
from braixdet.utils.io import atomic_write_bytes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "configs")

# Keys of the demo/paper configs that point at stage-1 outputs: a benchmark starts from a random
# init, so they are cleared (the timing does not depend on the weights).
_NO_STAGE1 = ("MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", "", "MODEL.WEIGHTS", "",
              "SSL.CAM_JSON", "", "SSL.USE_CAM", "False")


def set_threads():
    """torch threads from $BENCH_THREADS (default 2: the benchmark machine's core count)."""
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


def env_line(device, start_load):
    """The report's environment line; ``start_load``: the load average before the benchmark's
    own work (``args.start_load``), to tell a shared machine from the benchmark's own load."""
    la, la0 = load_average(), start_load
    line = (f"{device_line(device)}; "
            f"torch {torch.__version__}, threads {torch.get_num_threads()}, {cpu_model()} "
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


# Pretrained sources that work offline; any other (timm's "imagenet" hub weights) is replaced by
# random init: the timing does not depend on the weights, and a benchmark must not need internet.
_OFFLINE_PRETRAINED = ("", "efficientnet-lite0-package")


def build_cfg(config="demo/BRAIxDet/braixdet.yaml", opts=(), output_dir=None):
    """braixdet.config.build_cfg with stage-1 inputs cleared, OUTPUT_DIR set and
    MODEL.BRAIXDET.PRETRAINED "" (random init) unless the config's source is offline (the
    demo's efficientnet-lite0-package) or ``opts`` set it explicitly."""
    from braixdet.config import build_cfg as _build

    opts = list(_NO_STAGE1) + list(opts)
    if output_dir:
        opts += ["OUTPUT_DIR", output_dir]
    cfg = _build(config_path(config), opts)
    explicit = "MODEL.BRAIXDET.PRETRAINED" in opts[::2]
    if not explicit and cfg.MODEL.BRAIXDET.PRETRAINED not in _OFFLINE_PRETRAINED:
        cfg.defrost()
        cfg.MODEL.BRAIXDET.PRETRAINED = ""
    return cfg


# -- device, synchronisation, peak memory, AMP ------------------------------------------------

def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


AMP_INFERENCE = "torch.autocast around the calls (bf16 where supported, else fp16)"
AMP_TRAINING = ("SOLVER.AMP.ENABLED True: the step trainer's autocast (bf16 where supported, "
                "else fp16 with a gradient scaler)")


def add_device_args(ap, amp=True, what=AMP_INFERENCE):
    """--device, and (``amp``) --amp / --compare-amp; ``what`` says what --amp does."""
    ap.add_argument("--device", default=default_device(),
                    help="cpu | cuda | cuda:N (default: cuda when available, else cpu); "
                         "MODEL.DEVICE, inputs and timing synchronisation follow it")
    if amp:
        ap.add_argument("--amp", action="store_true",
                        help=f"mixed precision: {what}")
        ap.add_argument("--compare-amp", action="store_true",
                        help="run fp32 and AMP and print them side by side (time ratio, peak "
                             "memory of each)")


def add_grad_checkpointing_arg(ap):
    ap.add_argument("--grad-checkpointing", action="store_true",
                    help="MODEL.BRAIXDET.GRAD_CHECKPOINTING True (timm set_grad_checkpointing "
                         "on the encoder)")


def parse_args(ap):
    """The flags every benchmark shares (--opts, --out), parsed; threads set. ``args.device`` is
    the validated, normalised device (pass it to the helpers below) and ``args.start_load`` the
    load average before the benchmark's own work (for ``env_line``)."""
    ap.add_argument("--opts", nargs=argparse.REMAINDER, default=[], help="extra config opts")
    ap.add_argument("--out", default=None, help="also write the markdown report here")
    args = ap.parse_args()
    args.start_load = load_average()
    set_threads()
    args.device = check_device(args.device)
    return args


def check_device(device):
    """Validate ``--device`` (exits with a message if unusable), make cuda:N the current CUDA
    device, and return the normalised device string ("cuda:0", "cpu")."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit(f"--device {device}: CUDA is not available here (torch "
                     f"{torch.__version__}); use --device cpu")
        if dev.index is not None:
            torch.cuda.set_device(dev.index)
    elif dev.type != "cpu":
        sys.exit(f"--device {device}: only cpu and cuda[:N] are supported")
    return str(dev)


def device_type(device):
    return torch.device(device).type


def is_cuda(device):
    return device_type(device) == "cuda"


def sync(device):
    """Wait for the device's queued work (CUDA kernels run asynchronously): call before
    reading a clock. A no-op on CPU."""
    if is_cuda(device):
        torch.cuda.synchronize(torch.device(device))


def device_opts(device):
    """Config opts putting the model on the benchmark's device."""
    return ["MODEL.DEVICE", str(device)]


def to_device(x, device):
    """Tensors / Instances in (lists of) input dicts moved to the device (what a model does with
    its inputs anyway; moving them beforehand keeps host->device copies out of the timing)."""
    from detectron2.structures import Instances

    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, (torch.Tensor, Instances)):
        return x.to(device)
    return x


def amp_dtype(device):
    """The step trainers' AMP dtype on this device (``Precision.auto``: one rule for both)."""
    return Precision.auto(device_type(device)).dtype


def autocast(enabled, device):
    """The step trainers' autocast on ``device`` (a no-op when disabled)."""
    if not enabled:
        return contextlib.nullcontext()
    return Precision.auto(device_type(device)).autocast()


def precisions(args):
    """[False] (fp32), [True] (--amp) or [False, True] (--compare-amp)."""
    if getattr(args, "compare_amp", False):
        return [False, True]
    return [bool(getattr(args, "amp", False))]


def precision_name(amp, device):
    return f"AMP {str(amp_dtype(device)).replace('torch.', '')}" if amp else "fp32"


def amp_opts(amp):
    """Config opts of the step trainers' mixed precision (honoured by trainers that read it)."""
    return ["SOLVER.AMP.ENABLED", str(bool(amp))]


def grad_checkpointing_opts(enabled):
    """Opts of --grad-checkpointing (timm's set_grad_checkpointing on the encoder)."""
    return ["MODEL.BRAIXDET.GRAD_CHECKPOINTING", "True"] if enabled else []


def amp_status(requested, dtype_seen):
    """One line: did the requested AMP reach the model (dtype of a conv output in the step)?"""
    seen = str(dtype_seen).replace("torch.", "") if dtype_seen is not None else "?"
    if not requested:
        return f"fp32 (conv outputs {seen})"
    if dtype_seen is not None and dtype_seen != torch.float32:
        return f"AMP active (conv outputs {seen})"
    return f"AMP requested but NOT active: the step ran in fp32 (conv outputs {seen})"


def autocast_seen(module, fn):
    """Run ``fn`` once and return the dtype of the first Conv2d output of ``module`` seen during
    it (float32 = no autocast took effect; None = no conv ran)."""
    conv = next((m for m in module.modules() if isinstance(m, torch.nn.Conv2d)), None)
    seen = []
    if conv is None:
        fn()
        return None
    h = conv.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    try:
        fn()
    finally:
        h.remove()
    return seen[0] if seen else None


def reset_peak_memory(device):
    if is_cuda(device):
        sync(device)
        torch.cuda.reset_peak_memory_stats(torch.device(device))


def peak_memory_gib(device):
    """CUDA: max_memory_allocated since the last reset, in GiB; CPU: None (see process_rss)."""
    if is_cuda(device):
        sync(device)
        return torch.cuda.max_memory_allocated(torch.device(device)) / 2**30
    return None


def measure_peak(fn, device):
    """Peak device memory (GiB) of one call of ``fn``; None on CPU."""
    if not is_cuda(device):
        return None
    torch.cuda.empty_cache()
    reset_peak_memory(device)
    fn()
    return peak_memory_gib(device)


def process_peak_rss_gib():
    """The process's peak resident set size so far (getrusage; KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (2**30 if sys.platform == "darwin" else 2**20)


def gib(x):
    return "n/a" if x is None else f"{x:.2f}"


def memory_note(device):
    if is_cuda(device):
        return ("peak memory: `torch.cuda.max_memory_allocated` over one untimed call after "
                "`reset_peak_memory_stats`, GiB")
    return (f"peak memory: n/a per variant on CPU; process peak RSS (getrusage) "
            f"{process_peak_rss_gib():.2f} GiB")


def device_line(device):
    if is_cuda(device):
        d = torch.device(device)
        name = torch.cuda.get_device_name(d)
        total = torch.cuda.get_device_properties(d).total_memory / 2**30
        return (f"device {device} ({name}, {total:.0f} GiB; CUDA {torch.version.cuda}; AMP "
                f"dtype {str(amp_dtype(device)).replace('torch.', '')})")
    return f"device {device} (AMP dtype bfloat16)"


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


def timeit(fn, device):
    """Seconds of one call, ``device`` synchronised before and after."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def interleaved(fns, repeats, warmup, device):
    """Time each callable of ``fns`` (name -> fn) ``repeats`` times on ``device``, alternating
    the variants (A B A B ...; the order is rotated each round so no variant always runs after
    the same one) after ``warmup`` untimed rounds. Returns name -> list of seconds."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    out = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            out[n].append(timeit(fns[n], device))
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


def emit(title, text, args):
    """Print the report (title, environment line, tables) and optionally write it to --out.
    ``args``: ``parse_args``'s namespace (its device, start load and out)."""
    report = f"## {title}\n\n{env_line(args.device, args.start_load)}\n\n{text}\n"
    print(report)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(report)
    return report


def verdict(value, target, higher_is_worse=True):
    ok = value <= target if higher_is_worse else value >= target
    return "PASS" if ok else "MISS"


def plot_rows(per_seed, seeds, out_png, rows):
    """Each row's (``rows``: method keys) AP@0.2 per seed (dots, one colour a seed; a seed
    without the row has no dot) and its mean (bar), the ceiling's mean as a line when present:
    where the rows sit against it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def ap(summary, label):
        m = summary["results"].get(label)
        return None if m is None else row_metric(m)

    labels = [METHODS[k].label for k in rows]
    fig = Figure(figsize=(8.5, max(3.8, 0.45 * len(labels) + 1.0)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for i, label in enumerate(labels):
        values = [v for v in (ap(s, label) for s in per_seed) if v is not None]
        if values:
            ax.barh(i, sum(values) / len(values), color="0.85")
    for seed, summary in zip(seeds, per_seed):
        values = [ap(summary, label) for label in labels]
        ax.plot([float("nan") if v is None else v for v in values], range(len(labels)), "o",
                ms=5, label=f"seed {seed}")
    ceiling = [v for v in (ap(s, CEILING) for s in per_seed) if v is not None]
    if ceiling:
        ax.axvline(sum(ceiling) / len(ceiling), color="k", ls="--", lw=1,
                   label="full-label ceiling (mean)")
    ax.set_yticks(range(len(labels)), [textwrap.fill(t, 28) for t in labels], fontsize=8)
    ax.invert_yaxis()
    shown = [v for s in per_seed for v in (ap(s, t) for t in [*labels, CEILING]) if v is not None]
    ax.set_xlim(min(shown) - 5, max(shown) + 3)  # the bars' left ends are cut: dots matter
    ax.set_xlabel("AP@IoU0.2 (%), test split; bar: mean over seeds")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # off the dots
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    atomic_write_bytes(out_png, png.getvalue())  # a record's picture is replaced, never torn
    return out_png
