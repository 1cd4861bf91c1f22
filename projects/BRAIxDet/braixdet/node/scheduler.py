"""When a study is complete, and who predicts it: the node's queue and worker threads.

A study (``scp.study_key``) is queued when

* its four standard views (L/R x CC/MLO) are in and it has no result yet: at once; or
* no new instance of it has arrived for ``quiet_period`` seconds (our choice of default, 30 s
  in tools/serve.py: a modality sends an exam's views within seconds).

Instances arriving after a study's version k was committed (or while it was being predicted)
make it pending again: after the quiet period it is read again as a whole, giving version k+1,
whose SR has the same series as version k, InstanceNumber k+1 and version k's SR as its
predecessor document (a new version, not a duplicate). A re-sent instance changes nothing.

``workers`` threads take studies from the queue, each with its own ``ExamPredictor``
(the association threads only store files and call ``arrived``, they never wait on the model).
A worker predicts the study's stored files exactly as tools/predict.py does (``ExamPredictor``
exam grouping and pairing, ``inference/sr.py`` SR and GSPS, ``exam_scores`` scores) and
commits the result version with ``Spool.commit``; ``on_committed`` then wakes the sender.

Restart (``recover``): a study whose stored instances are not all covered by its last committed
version is pending again, its quiet period counted from the start; committed versions are never
predicted again, so nothing is processed twice.
"""
import contextlib
import dataclasses
import io
import logging
import queue
import threading
import time
from typing import Callable, Dict, Optional

import pydicom
from pydicom.uid import generate_uid

from ..data.report import BadInputReport
from ..evaluation.exam_scores import breast_exam_scores, image_score
from ..inference.deidentify import PseudonymMap
from ..inference.sr import exam_sr, image_presentation_state
from .scp import ReceivedInstance, instance_view
from .spool import Spool
from .status import NodeStatus

__all__ = ["FOUR_VIEWS", "StudyScheduler"]

logger = logging.getLogger(__name__)

FOUR_VIEWS = frozenset({("L", "CC"), ("L", "MLO"), ("R", "CC"), ("R", "MLO")})


@dataclasses.dataclass
class _Study:
    files: set = dataclasses.field(default_factory=set)  # instance keys stored
    covered: set = dataclasses.field(default_factory=set)  # ... in the last committed version
    views: Dict[str, Optional[tuple]] = dataclasses.field(default_factory=dict)
    version: int = 0
    last_arrival: float = 0.0
    state: str = "idle"  # idle | queued | running | failed

    @property
    def pending(self):
        return bool(self.files - self.covered)


class StudyScheduler:
    """Completion rules, queue and workers (module doc)."""

    def __init__(self, spool: Spool, status: NodeStatus, predictor_factory: Callable,
                 quiet_period: float = 30.0, workers: int = 1, score_thresh: float = 0.05,
                 sr_pseudonym_map: Optional[str] = None,
                 on_committed: Callable[[], None] = lambda: None):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.spool, self.status = spool, status
        self.predictor_factory = predictor_factory
        self.quiet_period, self.workers = float(quiet_period), int(workers)
        self.score_thresh, self.sr_pseudonym_map = float(score_thresh), sr_pseudonym_map
        self.on_committed = on_committed
        self._studies: Dict[str, _Study] = {}
        self._queue = queue.Queue()
        self._cv = threading.Condition()
        self._stop = False
        self._threads = []

    # -- state ----------------------------------------------------------------------------------
    def recover(self) -> int:
        """Load the spool's studies; returns how many are pending (module doc)."""
        now = time.monotonic()
        with self._cv:
            for study in self.spool.studies():
                files = self.spool.instances(study)
                manifests = self.spool.manifests(study)
                st = self._studies.setdefault(study, _Study())
                st.files = set(files)
                st.covered = set(manifests[-1]["instances"]) if manifests else set()
                st.version = manifests[-1]["version"] if manifests else 0
                if st.pending:
                    st.last_arrival = now
                    for inst, path in files.items():
                        try:
                            st.views[inst] = instance_view(
                                pydicom.dcmread(path, stop_before_pixels=True))
                        except Exception:  # noqa: BLE001 - the worker reports bad files
                            st.views[inst] = None
            pending = sum(st.pending for st in self._studies.values())
            self._update_gauges()
            self._cv.notify_all()
        return pending

    def arrived(self, received: ReceivedInstance, new: bool):
        """An instance was stored (``new``) or re-sent; called on an association thread."""
        with self._cv:
            st = self._studies.setdefault(received.study, _Study())
            st.last_arrival = time.monotonic()
            if new:
                st.files.add(received.instance)
                st.views[received.instance] = received.view
                if st.state == "failed":
                    st.state = "idle"
            self._update_gauges()
            self._cv.notify_all()

    @property
    def busy(self) -> bool:
        """A study is pending, queued or being predicted."""
        with self._cv:
            return any(st.pending and st.state != "failed" or st.state in ("queued", "running")
                       for st in self._studies.values())

    def _update_gauges(self):
        states = [st.state for st in self._studies.values()]
        self.status.gauge("studies", "known", len(states))
        self.status.gauge("studies", "pending", sum(
            st.pending and st.state == "idle" for st in self._studies.values()))
        self.status.gauge("studies", "queued", states.count("queued"))
        self.status.gauge("studies", "running", states.count("running"))

    def _ready(self, st: _Study, now: float) -> bool:
        if st.state != "idle" or not st.pending:
            return False
        if st.version == 0 and FOUR_VIEWS <= {v for v in st.views.values() if v}:
            return True
        return now - st.last_arrival >= self.quiet_period

    # -- threads --------------------------------------------------------------------------------
    def start(self):
        self._stop = False
        predictors = [self.predictor_factory() for _ in range(self.workers)]
        self._threads = [threading.Thread(target=self._tick, name="node-scheduler", daemon=True)]
        self._threads += [threading.Thread(target=self._work, args=(p,), daemon=True,
                                           name=f"node-worker-{i}")
                          for i, p in enumerate(predictors)]
        for t in self._threads:
            t.start()

    def stop(self):
        """Stop after the studies being predicted now (a queued one waits for the next start)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for _ in range(self.workers):
            self._queue.put(None)
        for t in self._threads:
            t.join()
        self._threads = []

    def _tick(self):
        step = min(max(self.quiet_period / 4, 0.02), 0.5)
        with self._cv:
            while not self._stop:
                now = time.monotonic()
                for study, st in sorted(self._studies.items()):
                    if self._ready(st, now):
                        st.state = "queued"
                        self._queue.put(study)
                self._update_gauges()
                self._cv.wait(step)

    def _work(self, predictor):
        try:
            while True:
                study = self._queue.get()
                if study is None:
                    return
                with self._cv:
                    if self._stop:
                        self._studies[study].state = "idle"
                        continue
                    self._studies[study].state = "running"
                    version = self._studies[study].version + 1
                    self._update_gauges()
                try:
                    covered = self._process(predictor, study, version)
                except Exception as e:  # noqa: BLE001 - one study must not stop the node
                    self.status.count("studies", "failed")
                    logger.error("study %s v%d failed (kept; retried on its next instance or "
                                 "the next start): %s: %s", study[:12], version,
                                 type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
                    with self._cv:
                        self._studies[study].state = "failed"
                        self._update_gauges()
                    continue
                with self._cv:
                    st = self._studies[study]
                    st.covered, st.version, st.state = covered, version, "idle"
                    self._update_gauges()
                    self._cv.notify_all()
                self.on_committed()
        finally:
            close = getattr(predictor, "close", None)
            if close is not None:
                close()

    # -- one study ------------------------------------------------------------------------------
    def _process(self, predictor, study: str, version: int) -> set:
        t0 = time.monotonic()
        files = self.spool.instances(study)
        previous = {s["exam"]: s for s in (self.spool.manifests(study) or [{}])[-1].get("srs", [])}
        report = BadInputReport("node")
        outputs, srs, n_images, n_boxes = {}, [], 0, 0
        exams = predictor.exams(list(files.values()), report)
        with contextlib.ExitStack() as stack:
            # the user's PseudonymMap (inference/deidentify.py), locked while this study's
            # results are made; none: the SR and GSPS carry the images' own patient module
            pseudonyms = stack.enter_context(PseudonymMap(self.sr_pseudonym_map, self.spool.root)
                                             ) if self.sr_pseudonym_map else None
            for exam_no, (exam, preds) in enumerate(predictor.predict_exams(exams, report)):
                if not preds:
                    continue
                breasts, exam_scores = breast_exam_scores(
                    (0, p.meta.laterality, image_score(p.scores)) for p in preds)
                sr = exam_sr([{"path": p.meta.path, "laterality": p.meta.laterality,
                               "boxes": p.boxes, "scores": p.scores} for p in preds],
                             {lat: s for (_, lat), s in breasts.items()}, exam_scores[0],
                             score_thresh=self.score_thresh, pseudonyms=pseudonyms)
                _as_version(sr, exam.key, version, previous.get(exam.key))
                outputs[f"sr_{exam_no}.dcm"] = _encode(sr)
                srs.append({"exam": exam.key, "sop": str(sr.SOPInstanceUID),
                            "series": str(sr.SeriesInstanceUID),
                            "study": str(sr.StudyInstanceUID)})
                for j, p in enumerate(preds):
                    outputs[f"pr_{exam_no}_{j}.dcm"] = _encode(image_presentation_state(
                        p.meta.path, p.boxes, p.scores, score_thresh=self.score_thresh,
                        laterality=p.meta.laterality, pseudonyms=pseudonyms))
                    n_boxes += int((p.scores >= self.score_thresh).sum())
                n_images += len(preds)
        self.spool.commit(study, version, outputs, {
            "instances": sorted(files), "images": n_images, "exams": len(srs), "srs": srs,
            "boxes": n_boxes, "bad_inputs": report.num_bad, "counts": dict(report.counts)})
        self.status.count("studies", "processed")
        self.status.count("studies", "versions_after_first" if version > 1 else "first_versions")
        logger.info("study %s v%d: %d of %d instances predicted in %d exams, %d boxes >= %g, "
                    "%d bad inputs, %.1f s", study[:12], version, n_images, len(files), len(srs),
                    n_boxes, self.score_thresh, report.num_bad, time.monotonic() - t0)
        return set(files)


def _as_version(sr, exam_key: str, version: int, previous: Optional[dict]):
    """Version ``version`` of the exam's SR: one series per exam, InstanceNumber = version,
    the previous version as predecessor document."""
    sr.SeriesInstanceUID = generate_uid(entropy_srcs=["braixdet-node-sr", exam_key])
    sr.InstanceNumber = version
    if previous:
        ref = pydicom.Dataset()
        ref.ReferencedSOPClassUID = sr.SOPClassUID
        ref.ReferencedSOPInstanceUID = previous["sop"]
        series = pydicom.Dataset()
        series.SeriesInstanceUID = previous["series"]
        series.ReferencedSOPSequence = [ref]
        item = pydicom.Dataset()
        item.StudyInstanceUID = previous["study"]
        item.ReferencedSeriesSequence = [series]
        sr.PredecessorDocumentsSequence = [item]


def _encode(ds) -> bytes:
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    return buf.getvalue()
