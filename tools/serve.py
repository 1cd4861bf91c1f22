#!/usr/bin/env python
"""Run BRAIxDet as a DICOM node: mammograms in by C-STORE, SR + presentation states back out.

  python tools/serve.py --config-file configs/BRAIxDet/braixdet.yaml \
      --weights output/braixdet/model_export.pth --ae-title BRAIXDET --port 11112 \
      --spool /var/spool/braixdet --send-to pacs.example.org:104:PACS --allow MODALITY1@10.0.0.7

A thin CLI over ``braixdet.node.DicomNode`` (receive into a spool, complete studies, predict with
``ExamPredictor``, send with retry; see docs/DESIGN.md "DICOM node"). Safe defaults: it listens on
127.0.0.1 and, without --allow, lets in loopback connections only. SIGINT/SIGTERM stop it after
the studies being predicted; the next start finishes whatever was pending.
"""
import argparse
import signal
import sys
import threading

from detectron2.utils.logger import setup_logger

from braixdet.cli import run_tool
from braixdet.config import build_cfg
from braixdet.engine.preflight import check_readable_file
from braixdet.inference.predictor import ExamPredictor
from braixdet.node import (
    AllowEntry,
    Destination,
    DicomNode,
    NodeSettings,
    client_tls_context,
    server_tls_context,
)


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config-file", required=True)
    ap.add_argument("--weights", required=True, help="model_export.pth or a stage-2 checkpoint")
    ap.add_argument("--ae-title", default="BRAIXDET")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    ap.add_argument("--port", type=int, default=11112, help="0: any free port")
    ap.add_argument("--spool", required=True, help="folder of received images and results")
    ap.add_argument("--send-to", type=Destination.parse, default=None, metavar="HOST:PORT:AET",
                    help="destination of the results (without it they stay in the outbox)")
    ap.add_argument("--allow", type=AllowEntry.parse, action="append", default=[],
                    metavar="AET[@ADDRESS]",
                    help="calling AE title let in (repeatable); none given: loopback only")
    ap.add_argument("--quiet-period", type=float, default=30.0,
                    help="seconds without a new instance after which a study is complete")
    ap.add_argument("--workers", type=int, default=1, help="prediction threads (own model each)")
    ap.add_argument("--score-thresh", type=float, default=0.05, help="kept in the SR / GSPS")
    ap.add_argument("--sr-pseudonymise", metavar="MAP.json", default=None,
                    help="research: de-identified SR / GSPS (PS3.15 Basic Profile); pseudonyms "
                         "in MAP.json, yours to keep outside the spool")
    ap.add_argument("--retry-base", type=float, default=5.0, help="first send retry delay, s")
    ap.add_argument("--retry-max", type=float, default=300.0, help="longest send retry delay, s")
    ap.add_argument("--min-free-mb", type=int, default=512,
                    help="refuse instances (0xA700) when the spool has less free space")
    ap.add_argument("--tls-cert", default=None, help="PEM certificate: the SCP speaks TLS")
    ap.add_argument("--tls-key", default=None)
    ap.add_argument("--tls-ca", default=None,
                    help="PEM CA: callers must present a certificate it signed; also verifies "
                         "the --send-to destination, which is then reached over TLS")
    ap.add_argument("--max-runtime", type=float, default=None, help="stop after these seconds")
    ap.add_argument("--exit-when-idle", type=float, default=None, metavar="SECONDS",
                    help="stop once nothing is open, pending or unsent for SECONDS")
    ap.add_argument("opts", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        ap.error("--tls-cert and --tls-key go together")
    return args


def main(argv=None):
    args = _parse(argv)
    setup_logger(name="braixdet")
    check_readable_file("--weights", args.weights)
    cfg = build_cfg(args.config_file, ["MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", "", *args.opts])
    cfg.freeze()
    settings = NodeSettings(
        spool=args.spool, ae_title=args.ae_title, host=args.host, port=args.port,
        allow=tuple(args.allow), destination=args.send_to, quiet_period=args.quiet_period,
        workers=args.workers, score_thresh=args.score_thresh,
        sr_pseudonym_map=args.sr_pseudonymise, retry_base=args.retry_base,
        retry_max=args.retry_max, min_free_mb=args.min_free_mb,
        server_tls=server_tls_context(args.tls_cert, args.tls_key, args.tls_ca)
        if args.tls_cert else None,
        client_tls=client_tls_context(args.tls_ca) if args.tls_ca else None)
    node = DicomNode(settings, lambda: ExamPredictor(cfg, args.weights, num_workers=0))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, node.request_stop)
        signal.signal(signal.SIGINT, node.request_stop)
    with node:
        print(f"DICOM node {args.ae_title} on {args.host}:{node.port}, spool {args.spool}",
              flush=True)
        node.run(max_runtime=args.max_runtime, exit_when_idle=args.exit_when_idle)
    return node.status.snapshot()


if __name__ == "__main__":
    sys.exit(run_tool(main))
