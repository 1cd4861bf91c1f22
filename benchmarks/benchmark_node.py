"""Load on the DICOM node (braixdet/node): images/s received, exams/min predicted, peak memory.

    python benchmarks/benchmark_node.py [--associations 8] [--studies-per-association 8]
        [--orig 512 384] [--size 256 128] [--workers 1] [--detections 5] [--device cpu]

``--associations`` pynetdicom SCU threads in this process each open one association and send
their own 4-view studies (distinct instances, 16-bit, explicit VR, ``--orig`` pixels) as fast as
the node answers, while the node (same process, 127.0.0.1, random-init demo detector at
``--size``) spools, completes studies by their four views and predicts them with ``--workers``
threads; the results go to a pynetdicom storage SCP in this process. Reported: C-STORE
throughput (received images/s, until the last answer), exams/min until the last study was
predicted and until the last result was acknowledged, the process's peak RSS (clients, node and
receiver together: an upper bound of the node's own), and that every instance was stored once
and every study predicted once.
"""
import argparse
import os
import shutil
import tempfile
import threading
import time

import _common as C
import numpy as np
import pydicom
import torch
from detectron2.modeling import build_model
from pydicom.uid import ExplicitVRLittleEndian, generate_uid
from pynetdicom import AE, evt
from pynetdicom.sop_class import (
    ComprehensiveSRStorage,
    DigitalMammographyXRayImageStorageForPresentation,
    GrayscaleSoftcopyPresentationStateStorage,
)

from braixdet.data.dicom import write_dicom
from braixdet.inference.predictor import ExamPredictor
from braixdet.node import Destination, DicomNode, NodeSettings
from braixdet.utils.checkpoint import export_model_only

VIEWS = (("L", "CC"), ("L", "MLO"), ("R", "CC"), ("R", "MLO"))


def make_study(folder, patient, orig, rng):
    rows, cols = orig
    yy, xx = np.mgrid[:rows, :cols]
    study = generate_uid()
    paths = []
    for lat, view in VIEWS:
        x = xx if lat == "L" else cols - 1 - xx
        breast = ((yy - rows / 2) / (rows * 0.45)) ** 2 + (x / (cols * 0.8)) ** 2 < 1
        pixels = (breast * (1500 + rng.integers(0, 800, orig))).astype(np.uint16)
        paths.append(write_dicom(os.path.join(folder, f"{patient}_{lat}{view}.dcm"), pixels,
                                 bits_stored=12, ImageLaterality=lat, ViewPosition=view,
                                 PatientID=patient, StudyDate="20260101",
                                 StudyInstanceUID=study))
    return paths


def receiver():
    received = []
    ae = AE("DEST")
    for cls in (ComprehensiveSRStorage, GrayscaleSoftcopyPresentationStateStorage):
        ae.add_supported_context(cls, ExplicitVRLittleEndian)
    server = ae.start_server(("127.0.0.1", 0), block=False, evt_handlers=[
        (evt.EVT_C_STORE, lambda e: received.append(1) or 0x0000)])
    return server, received


def send(port, files, statuses):
    ae = AE("BENCH")
    ae.add_requested_context(DigitalMammographyXRayImageStorageForPresentation,
                             ExplicitVRLittleEndian)
    assoc = ae.associate("127.0.0.1", port, ae_title="BRAIXDET")
    for f in files:
        statuses.append(int(assoc.send_c_store(pydicom.dcmread(f)).Status))
    assoc.release()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--associations", type=int, default=8)
    ap.add_argument("--studies-per-association", type=int, default=8,
                    help="4 images each (default: 8 x 32 images)")
    ap.add_argument("--orig", type=int, nargs=2, default=(512, 384), metavar=("H", "W"))
    ap.add_argument("--size", type=int, nargs=2, default=(256, 128), metavar=("H", "W"),
                    help="canonical size (INPUT.BRAIXDET.CANONICAL_SIZE)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--detections", type=int, default=5,
                    help="TEST.DETECTIONS_PER_IMAGE: a random-init detector scores its 100 "
                         "default boxes alike, and the SR costs grow with the boxes kept")
    ap.add_argument("--config", default="demo/BRAIxDet/braixdet.yaml")
    C.add_device_args(ap, amp=False)
    args = C.parse_args(ap)
    tmp = tempfile.mkdtemp(prefix="braixdet-bench-node-")
    try:
        cfg = C.build_cfg(args.config, [*C.size_opts(args.size), *C.device_opts(args.device),
                                        "INPUT.BRAIXDET.CACHE_DIR", os.path.join(tmp, "cache"),
                                        "TEST.DETECTIONS_PER_IMAGE", str(args.detections),
                                        *args.opts], output_dir=os.path.join(tmp, "o"))
        cfg.freeze()
        weights = export_model_only(build_model(cfg), os.path.join(tmp, "w.pth"))
        rng = np.random.default_rng(0)
        plans = [[f for s in range(args.studies_per_association)
                  for f in make_study(tmp, f"A{a}S{s}", tuple(args.orig), rng)]
                 for a in range(args.associations)]
        n_images = sum(map(len, plans))
        n_studies = n_images // 4
        server, received = receiver()
        settings = NodeSettings(spool=os.path.join(tmp, "spool"), port=0, quiet_period=60.0,
                                workers=args.workers, min_free_mb=0, retry_base=0.2,
                                destination=Destination("127.0.0.1", server.server_address[1],
                                                        "DEST"))
        node = DicomNode(settings, lambda: ExamPredictor(cfg, weights, num_workers=0))
        statuses = []
        with node:
            t0 = time.perf_counter()
            threads = [threading.Thread(target=send, args=(node.port, p, statuses))
                       for p in plans]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            t_recv = time.perf_counter() - t0
            while node.status.get("studies", "processed") < n_studies:
                time.sleep(0.05)
            t_pred = time.perf_counter() - t0
            while node.sender.pending() or node.scheduler.busy:
                time.sleep(0.05)
            t_sent = time.perf_counter() - t0
            counts = node.status.snapshot()
        server.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ok = (statuses == [0] * n_images and counts["instances"].get("stored") == n_images and
          "already_stored" not in counts["instances"] and
          counts["studies"]["processed"] == counts["studies"]["first_versions"] == n_studies and
          len(received) == n_studies * 5)
    rows = [[f"{args.associations} x {n_images // args.associations}", n_images, n_studies,
             f"{n_images / t_recv:.1f}", f"{60 * n_studies / t_pred:.1f}",
             f"{60 * n_studies / t_sent:.1f}", f"{C.process_peak_rss_gib():.2f}",
             "yes" if ok else "NO"]]
    text = C.md_table(["associations x images", "images", "studies", "received images/s",
                       "exams/min predicted", "exams/min acknowledged", "peak RSS GiB",
                       "each stored once, predicted once"], rows)
    text += (f"\n\nimages {args.orig[0]}x{args.orig[1]} 16-bit explicit VR, canonical "
             f"{args.size[0]}x{args.size[1]}, {args.detections} detections per image, "
             f"{args.workers} worker(s), torch threads "
             f"{torch.get_num_threads()}; C-STORE answered after {t_recv:.1f} s, last study "
             f"predicted after {t_pred:.1f} s, last result acknowledged after {t_sent:.1f} s")
    C.emit("DICOM node under load", text, args)
    if not ok:
        raise SystemExit(f"node lost or repeated work: {counts}")
    return counts


if __name__ == "__main__":
    main()
