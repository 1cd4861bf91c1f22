"""Exam-level inference on DICOM files, the package's DefaultPredictor: files in, boxes out.

detectron2's ``DefaultPredictor`` (detectron2/engine/defaults.py) owns single-image inference;
here a "sample" is an exam, because each image is detected with its ipsilateral partner view as
the auxiliary input. ``ExamPredictor``:

* reads DICOM headers, groups the images into exams (``group_exams``) and breasts (laterality),
  and pairs CC <-> MLO with the training pairing rule (``braixdet/data/pairing.py``): every image
  is the main view once; a missing partner makes the image its own auxiliary view, as in
  training, counted as ``aux_missing`` in the report;
* computes every image's canonical pixels through the SAME code as training and evaluation:
  the ``CanonicalCache`` of a test-time ``MultiViewDatasetMapper`` built from the config
  (``braixdet/data/mapper.py``; same canonical size, mask parameters, 16-bit quantisation,
  format), so the model never sees other pixels at inference than in evaluation;
* reads each file twice at most: its header once (``exams``: the exams must be known before
  any pixel is read), then header and pixels in ONE ``dcmread`` whose decode serves both the
  canonical image and, with ``keep_images``, the original image for overlays
  (``ImagePrediction.image``, uint8); a cache hit skips the decode unless the original is
  kept;
* encodes each image once per exam (``MultiViewRCNN.inference_exam``) and returns, per image, the
  boxes in ORIGINAL DICOM pixel coordinates with their scores (with
  ``TEST.BRAIXDET.PAIRED_VIEW_RESCORE``, × the partner view's top score, as evaluated);
* decodes and canonicalises the next exams in ``num_workers`` DataLoader worker processes while
  the model runs on the current one (``predict_exams``; 0 = in this process, same results).

Each input FILE is one output record: ``record_id`` is its SOPInstanceUID, with a suffix
``_dup2``, ``_dup3``, ... for a second, third, ... file (by path) carrying the same UID (counted
``duplicate_sop_uid``), so records, overlays and SR findings never merge two files.

Cache folder (choice): ``INPUT.BRAIXDET.CACHE_DIR`` when set (entries shared with training and
evaluation, keyed by path, size, mtime and laterality, so images seen there are not decoded
again); otherwise a private temporary folder, deleted by ``close()`` (or when the predictor is
garbage collected), so inference leaves no canonical images of patients behind. The mapper's
default (``<OUTPUT_DIR>/../cache``) is not used: a prediction run has no training OUTPUT_DIR.

Unreadable files and images without a CC/MLO view or laterality are one line each in the
``BadInputReport`` and never stop the run; the other images of the exam are still predicted
(a partner lost that way makes its pair ``aux_missing``).
"""
import dataclasses
import logging
import os
import tempfile
from collections import defaultdict
from typing import Iterable, List, Optional, Sequence

import numpy as np
import torch
from detectron2.modeling import build_model
from detectron2.structures import Instances

from ..config import inference_cfg
from ..data.dicom import DicomMeta, pseudonymise, read_dicom_image, read_dicom_meta
from ..data.mapper import MultiViewDatasetMapper
from ..data.pairing import pair_views
from ..data.report import BadInputError, BadInputReport
from ..data.views import normalize_laterality, normalize_view
from ..evaluation.exam_scores import paired_view_rescore
from ..utils.checkpoint import load_inference_weights
from .visualize import display_image

__all__ = ["DICOM_SUFFIXES", "Exam", "ExamPredictor", "ImagePrediction", "ViewPair",
           "assign_record_ids", "find_dicoms", "group_exams", "pair_exam", "read_metas"]

logger = logging.getLogger(__name__)

DICOM_SUFFIXES = (".dcm", ".dicom", "")  # files in an input folder; "" = no extension


@dataclasses.dataclass(frozen=True)
class Exam:
    """The images of one study, sorted by (laterality, view, SOPInstanceUID, path)."""

    study_uid: str
    images: tuple  # of DicomMeta
    key: str = ""  # identifier-free exam key (group_exams)
    record_ids: tuple = ()  # one per image, unique over the run (assign_record_ids); () = UIDs

    def record_id(self, i: int) -> str:
        return self.record_ids[i] if self.record_ids else self.images[i].sop_uid


@dataclasses.dataclass(frozen=True)
class ViewPair:
    """One detection input: ``main`` with its partner view ``aux`` (None: no partner, the main
    image is its own auxiliary view)."""

    main: DicomMeta
    aux: Optional[DicomMeta]


@dataclasses.dataclass(frozen=True, eq=False)
class ImagePrediction:
    """Detections of one image. ``instances``: CPU ``Instances`` of size (rows, cols) with
    ``pred_boxes`` (XYXY, original DICOM pixels), ``scores`` and ``pred_classes``."""

    meta: DicomMeta
    aux_sop_uid: str  # the partner view used as auxiliary input (its own UID when aux_missing)
    aux_missing: bool
    instances: Instances
    record_id: str = ""  # unique per input file (module doc)
    image: Optional[np.ndarray] = None  # original image, uint8 grey (``keep_images``), or None

    @property
    def boxes(self) -> np.ndarray:
        return self.instances.pred_boxes.tensor.numpy()

    @property
    def scores(self) -> np.ndarray:
        return self.instances.scores.numpy()


def find_dicoms(inputs: Iterable[str]) -> List[str]:
    """Files given directly, plus the DICOM-named files under given folders; sorted, unique."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    files = set()
    for p in map(os.fspath, inputs):
        if os.path.isdir(p):
            for dirpath, _, names in os.walk(p):
                files.update(os.path.join(dirpath, n) for n in names
                             if os.path.splitext(n)[1].lower() in DICOM_SUFFIXES)
        else:
            files.add(p)  # a missing file is reported by read_metas
    return sorted({os.path.normpath(f) for f in files})


def read_metas(files: Iterable[str], report: BadInputReport, allow_for_processing=False,
               overrides=None) -> List[DicomMeta]:
    """Header of every readable file; each unreadable one is one line in ``report``, and so is
    an image whose UIDs are missing or whose identity / UID values are invalid for their VR
    (``missing_uid``, ``invalid_value``: the SR and presentation states copy them).

    ``overrides``: a ``ViewOverrides`` (``braixdet.data.views.load_views_csv``); a file's row
    replaces what its tags say (non-empty cells only), counted ``views_csv_override``."""
    metas = []
    for f in files:
        try:
            m = read_dicom_meta(f, allow_for_processing=allow_for_processing, check_values=True)
        except BadInputError as e:
            report.add(e)
            continue
        row = overrides.lookup(f) if overrides is not None else None
        if row is not None:
            lat, view = row["laterality"] or m.laterality, row["view"] or m.view
            m = dataclasses.replace(
                m, laterality=lat, view=view,
                exam_hint=_CSV_EXAM + pseudonymise(row["exam"]) if row["exam"] else m.exam_hint,
                view_problem="" if lat and view else m.view_problem)
            report.count("views_csv_override")
        metas.append(m)
    return metas


_CSV_EXAM = "csv:"  # exam_hint prefix of an exam given by the views CSV


def exam_key(meta: DicomMeta, uid_shared: bool) -> tuple:
    """The exam of one image (see ``group_exams``); parts are pseudonyms or UIDs."""
    if meta.exam_hint.startswith(_CSV_EXAM):
        return ("csv", meta.patient_id, meta.exam_hint)
    if meta.study_uid and uid_shared:
        return ("study", meta.patient_id, meta.study_uid)
    if meta.patient_id and meta.exam_hint:
        return ("patient", meta.patient_id, meta.exam_hint)
    if meta.study_uid:
        return ("study", meta.patient_id, meta.study_uid)
    return ("file", os.path.abspath(meta.path))


def group_exams(metas: Iterable[DicomMeta], report: BadInputReport) -> List[Exam]:
    """Exams of the CC/MLO images with a laterality, sorted by (StudyInstanceUID, first path).

    An image without a CC/MLO-like view or laterality is one report line (``unknown_view``,
    ``refused_view`` for spot/magnification/... views, ``view_conflict`` /
    ``laterality_conflict`` for coded tags that disagree) naming the tags tried, and left out.
    The exam of an image, first rule that applies (our choice; ``patient`` is the
    pseudonymised patient stem, ``P_00173`` for CBIS-DDSM's ``Mass-Test_P_00173_LEFT_CC``):

    1. (patient, the ``exam`` of its views-CSV row): a CSV exam holding images of several
       patients becomes one exam per patient (one ``csv_exam_split`` line);
    2. (patient, StudyInstanceUID) when another instance (SOPInstanceUID) of the same patient
       has that UID;
    3. (patient, AccessionNumber, else StudyDate): archives that give every image its own
       StudyInstanceUID, as CBIS-DDSM does. Such a group that holds one view of one breast
       twice (two studies of one day, or a retake filed as its own study) is split back into
       its studies (one ``ambiguous_exam`` line): images of two studies are never paired;
    4. its own StudyInstanceUID;
    5. no UID and no patient/date: an exam of its own (counted ``no_study_uid``): pairing it
       with other such images could pair two patients.

    Inside an exam, a view of a breast acquired twice is one ``repeat_view`` line (both are
    predicted; the partner is the first by SOPInstanceUID, the training rule of ``pair_exam``)
    and a second file with the same SOPInstanceUID one ``duplicate_file`` line (predicted as its
    own record; it stays in the exam of the first). These lines are kept inputs
    (``BadInputReport.note``) and hold no identifier.

    ``Exam.key`` is a pseudonym of that rule's key (no identifier); ``Exam.study_uid`` is the
    shared StudyInstanceUID under rule 2 or 4, else "".
    """
    usable = []
    for m in metas:
        lat, view = normalize_laterality(m.laterality or ""), normalize_view(m.view or "")
        if lat is None or view is None:
            report.add(BadInputError(m.path, m.view_problem or "unknown_view", m.view_note or
                                     f"laterality={m.laterality} view={m.view}"))
            continue
        if (lat, view) != (m.laterality, m.view):
            m = dataclasses.replace(m, laterality=lat, view=view)
        usable.append(m)
    instances = defaultdict(set)  # (patient, StudyInstanceUID) -> SOPInstanceUIDs
    for m in usable:
        if m.study_uid:
            instances[(m.patient_id, m.study_uid)].add(m.sop_uid)
    exams = defaultdict(list)
    for m in usable:
        key = exam_key(m, len(instances[(m.patient_id, m.study_uid)]) > 1)
        if key[0] == "file":
            report.count("no_study_uid")
        exams[key].append(m)
    _note_csv_exam_splits(exams, report)
    for key in [k for k in exams if k[0] == "patient"]:
        images = exams[key]
        if _repeated_views(images) and len({m.study_uid for m in images}) > 1:
            del exams[key]
            for m in images:
                exams[("study", m.patient_id, m.study_uid)].append(m)
            report.note(BadInputError(
                min(m.path for m in images), "ambiguous_exam",
                f"{len({m.study_uid for m in images})} studies of one patient and day without a "
                "shared StudyInstanceUID hold the same view twice: each study is its own exam"))
    out = [Exam(study_uid=key[2] if key[0] == "study" else "", images=tuple(sorted(
        v, key=lambda m: (m.laterality, m.view, m.sop_uid, m.path))),
        key=pseudonymise("exam|" + "|".join(key))) for key, v in exams.items()]
    for exam in out:
        _note_repeats(exam.images, report)
    return sorted(out, key=lambda e: (e.study_uid, min(m.path for m in e.images)))


def _repeated_views(images):
    """(laterality, view) -> its SOPInstanceUIDs, for the views held by several instances."""
    uids = defaultdict(set)
    for m in images:
        uids[(m.laterality, m.view)].add(m.sop_uid)
    return {k: v for k, v in uids.items() if len(v) > 1}


def _note_repeats(images, report):
    """``repeat_view`` and ``duplicate_file`` lines of one exam (``group_exams``)."""
    for (lat, view), uids in sorted(_repeated_views(images).items()):
        retake = min((m for m in images if (m.laterality, m.view) == (lat, view)
                      and m.sop_uid != min(uids)), key=lambda m: (m.sop_uid, m.path))
        report.note(BadInputError(retake.path, "repeat_view", (
            f"{lat} {view} acquired {len(uids)} times in one exam: each is predicted; the "
            "other view's partner is the first by SOPInstanceUID")))
    seen = set()
    for m in sorted(images, key=lambda m: m.path):
        if m.sop_uid in seen:
            report.note(BadInputError(m.path, "duplicate_file", (
                "same SOPInstanceUID as another input file: predicted as its own record in "
                "the same exam")))
        seen.add(m.sop_uid)


def _note_csv_exam_splits(exams, report):
    """One ``csv_exam_split`` line per views-CSV exam that names images of several patients
    (rule 1 keeps one exam per patient)."""
    patients = defaultdict(set)  # CSV exam (pseudonym) -> patients
    for key in exams:
        if key[0] == "csv":
            _, patient, csv_exam = key
            patients[csv_exam].add(patient)
    for hint, pids in patients.items():
        if len(pids) > 1:
            path = min(m.path for k, v in exams.items() if k[0] == "csv" and k[2] == hint
                       for m in v)
            report.note(BadInputError(path, "csv_exam_split", (
                f"the views CSV gives one exam to images of {len(pids)} patients: one exam "
                "per patient")))


def pair_exam(images: Sequence[DicomMeta], report: Optional[BadInputReport] = None
              ) -> List[ViewPair]:
    """CC <-> MLO pairs of one exam's images (``group_exams`` order), by the training rule of
    ``braixdet.data.pairing.pair_views``: partner = the other view of the same breast, the
    first by SOPInstanceUID among repeat acquisitions; none -> ``aux=None``, counted
    ``aux_missing`` in ``report``."""
    by_path = {m.path: m for m in images}
    if len(by_path) != len(images):
        raise ValueError("pair_exam: the same file twice in one exam")
    dicts = [{"patient_id": "", "exam_id": "", "laterality": m.laterality, "view": m.view,
              "image_id": m.sop_uid, "file_name": m.path} for m in images]
    pair_views(dicts, report)
    return [ViewPair(main=m, aux=None if d["aux_missing"] else by_path[d["aux_file_name"]])
            for m, d in zip(images, dicts)]


def assign_record_ids(exams: Sequence[Exam], report: BadInputReport) -> List[Exam]:
    """``exams`` with ``record_ids``: the SOPInstanceUID, suffixed ``_dup<n>`` for a file (in
    path order) with an already used UID, n >= 2 the first suffix that is neither used nor
    another file's UID (a file may carry a crafted ``<uid>_dup2``: one output file per record);
    each duplicate counted ``duplicate_sop_uid``."""
    metas = sorted((m for e in exams for m in e.images), key=lambda m: m.path)
    taken = {m.sop_uid for m in metas}  # every UID keeps its own name for its first file
    used, ids = set(), {}
    for m in metas:
        rid, n = m.sop_uid, 1
        while rid in used or (n > 1 and rid in taken):
            n += 1
            rid = f"{m.sop_uid}_dup{n}"
        if n > 1:
            report.count("duplicate_sop_uid")
        used.add(rid)
        ids[m.path] = rid
    return [dataclasses.replace(e, record_ids=tuple(ids[m.path] for m in e.images))
            for e in exams]


@dataclasses.dataclass(frozen=True)
class _Pixels:
    """One image as the model and the overlays get it."""

    canonical: torch.Tensor  # (1, H, W) float32
    transform: object  # original -> canonical TransformList
    original: Optional[torch.Tensor] = None  # (rows, cols) uint8 (``keep_images``), else None


class _ExamPixels(torch.utils.data.Dataset):
    """Item i: {path: ``_Pixels`` or a ``_Failed``} of exam i's images (DataLoader workers
    compute them; errors travel as values so the report stays in the main process)."""

    def __init__(self, load, exams):
        self.load, self.exams = load, exams

    def __len__(self):
        return len(self.exams)

    def __getitem__(self, i):
        out = {}
        for m in self.exams[i].images:
            try:
                out[m.path] = self.load(m)
            except BadInputError as e:  # its __init__ signature does not unpickle
                out[m.path] = _Failed(e.path, e.reason, e.detail)
        return out


@dataclasses.dataclass(frozen=True)
class _Failed:
    path: str
    reason: str
    detail: str


def _as_is(item):
    return item  # no collation: an item is one exam's dict


class _Loader:
    """Picklable image loader for the workers: the mapper's cache only, not the model.
    ``keep_original``: the file is decoded (one ``dcmread``) even on a cache hit, for its
    original image; on a miss that decode is the one the canonical image is made from."""

    def __init__(self, cache, keep_original=False):
        self.cache, self.keep_original = cache, bool(keep_original)

    def __call__(self, meta: DicomMeta) -> _Pixels:
        decoded = None
        if self.keep_original:  # a BadInputError here is the one the cache would raise
            decoded = read_dicom_image(meta.path, self.cache.allow_for_processing)
        try:
            img, tfm, info = self.cache.get_with_info(meta.path, meta.laterality,
                                                      decoded=decoded)
        except ValueError as e:  # e.g. an empty image; the mapper skips these too
            raise BadInputError(meta.path, "unsupported", str(e).replace("\n", " ")) from None
        if info.get("laterality_disagreement"):
            # the tags name one breast, the image's chest wall the other: its findings would be
            # scored (and filed) under a breast we cannot trust, so it is refused
            raise BadInputError(meta.path, "laterality_conflict", (
                f"the tags say {meta.laterality}, the chest wall is on the image's "
                f"{info.get('chest_wall_side')} (mass ratio {info.get('mass_ratio', 0):.2f})"))
        # tensors, not arrays: DataLoader workers hand them over in shared memory
        original = None if decoded is None else torch.from_numpy(display_image(decoded[0]))
        return _Pixels(torch.from_numpy(np.ascontiguousarray(img, dtype=np.float32)[None]), tfm,
                       original)


def _channels_last_encoder(model):
    """On CPU, the encoder's weights in channels-last memory: oneDNN runs EfficientNet's depthwise
    convolutions ~1.9x faster so (docs/RESULTS.md §12); detections equal to float rounding. Other
    devices keep the layout they were trained in (not measured there)."""
    encoder = getattr(getattr(model.backbone, "bottom_up", None), "encoder", None)
    if encoder is not None and model.device.type == "cpu":
        encoder.to(memory_format=torch.channels_last)


class ExamPredictor:
    """Build the model of ``cfg`` with ``weights`` (the teacher when the checkpoint holds one)
    and detect on DICOM exams::

        predictor = ExamPredictor(cfg, "output/braixdet/model_export.pth")
        for p in predictor(["/exams/2024-06/"]):
            print(p.meta.sop_uid, p.boxes, p.scores)

    ``share_features=False`` runs the model once per (main, aux) pair instead of encoding each
    image once per exam (same detections; for checking). ``cache_dir``: see the module doc.
    ``num_workers``: DataLoader processes decoding ahead of the model (0: serial, same results).
    ``keep_images``: each prediction keeps its original image (``ImagePrediction.image``, uint8)
    from the decode that made the model's pixels, for overlays (tools/predict.py).
    """

    def __init__(self, cfg, weights: str, share_features: bool = True,
                 cache_dir: Optional[str] = None, num_workers: int = 2,
                 keep_images: bool = False):
        cfg = inference_cfg(cfg, weights)  # the encoder is not built from ImageNet weights
        self.cfg = cfg
        self.model = build_model(cfg)
        load_inference_weights(self.model, weights)
        self.model.eval()
        _channels_last_encoder(self.model)
        self.share_features = bool(share_features)
        if int(num_workers) < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.num_workers = int(num_workers)
        self.keep_images = bool(keep_images)
        self.allow_for_processing = bool(cfg.INPUT.BRAIXDET.ALLOW_FOR_PROCESSING)
        self._tmp = None
        cache_dir = cache_dir or cfg.INPUT.BRAIXDET.CACHE_DIR
        if not cache_dir:
            self._tmp = tempfile.TemporaryDirectory(prefix="braixdet-predict-cache-")
            cache_dir = self._tmp.name
        # The test-time mapper of evaluation, for its cache: same parameters, same pixels.
        self.mapper = MultiViewDatasetMapper(
            **{**MultiViewDatasetMapper.from_config(cfg, is_train=False), "cache_dir": cache_dir})

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self):
        """Delete the temporary cache folder (if this predictor made one)."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- inputs ---------------------------------------------------------------------------------
    def exams(self, inputs: Iterable[str], report: BadInputReport, overrides=None
              ) -> List[Exam]:
        """Exams of the DICOM files and folders ``inputs`` (headers only); ``overrides``: a
        views CSV (``braixdet.data.views.load_views_csv``), see ``read_metas``."""
        return assign_record_ids(group_exams(read_metas(
            find_dicoms(inputs), report, self.allow_for_processing, overrides=overrides),
            report), report)

    def load(self, meta: DicomMeta):
        """(canonical (1, H, W) float32 tensor, original -> canonical transform) of one image,
        from the mapper's cache (computed on a miss). Raises BadInputError."""
        pixels = _Loader(self.mapper.cache)(meta)
        return pixels.canonical, pixels.transform

    # -- inference ------------------------------------------------------------------------------
    def predict_exams(self, exams: Sequence[Exam], report: BadInputReport):
        """Yield (exam, predictions) per exam; the pixels of the next exams are computed by
        ``num_workers`` DataLoader workers meanwhile (our choice: one exam per item, so the
        model always gets a whole exam)."""
        loader = torch.utils.data.DataLoader(
            _ExamPixels(_Loader(self.mapper.cache, self.keep_images), list(exams)),
            batch_size=None,
            shuffle=False, num_workers=self.num_workers, collate_fn=_as_is)
        for exam, pixels in zip(exams, loader):
            yield exam, self.predict_exam(exam, report, pixels)

    @torch.no_grad()
    def predict_exam(self, exam: Exam, report: BadInputReport, pixels=None
                     ) -> List[ImagePrediction]:
        """Detections of every readable image of one exam, in ``exam.images`` order.
        ``pixels``: an item of ``_ExamPixels`` (computed here when None)."""
        if pixels is None:
            pixels = _ExamPixels(_Loader(self.mapper.cache, self.keep_images), [exam])[0]
        loaded = {}
        for m in exam.images:
            if isinstance(pixels[m.path], _Failed):
                report.add(BadInputError(**dataclasses.asdict(pixels[m.path])))
            else:
                loaded[m.path] = pixels[m.path]
        good = [m for m in exam.images if m.path in loaded]
        if not good:
            return []
        pairs = pair_exam(good, report)  # after loading: a lost partner makes aux_missing
        idx = {m.path: i for i, m in enumerate(good)}
        images = [loaded[m.path].canonical for m in good]
        transforms = [loaded[m.path].transform for m in good]
        sizes = [(int(m.rows), int(m.cols)) for m in good]  # as the dataset dicts' height/width
        index_pairs = [(idx[p.main.path], idx[(p.aux or p.main).path]) for p in pairs]
        if self.share_features:
            outs = self.model.inference_exam(images, index_pairs, transforms=transforms,
                                             sizes=sizes)
        else:
            outs = [self.model([{"image": images[mi], "aux_image": images[ai],
                                 "transforms": transforms[mi], "height": sizes[mi][0],
                                 "width": sizes[mi][1]}])[0] for mi, ai in index_pairs]
        outs = [o["instances"].to("cpu") for o in outs]
        if self.cfg.TEST.BRAIXDET.PAIRED_VIEW_RESCORE:  # as the evaluator scores (its doc)
            rescored = paired_view_rescore({k: o.scores.numpy() for k, o in enumerate(outs)},
                                           dict(index_pairs))
            for k, o in enumerate(outs):
                o.scores = torch.as_tensor(rescored[k], dtype=o.scores.dtype)
        record = {m.path: exam.record_id(i) for i, m in enumerate(exam.images)}
        original = {path: px.original for path, px in loaded.items()}
        return [ImagePrediction(meta=p.main, aux_sop_uid=(p.aux or p.main).sop_uid,
                                aux_missing=p.aux is None, instances=o,
                                record_id=record[p.main.path],
                                image=None if original[p.main.path] is None else
                                original[p.main.path].numpy())
                for p, o in zip(pairs, outs)]

    def __call__(self, inputs: Iterable[str], report: Optional[BadInputReport] = None
                 ) -> List[ImagePrediction]:
        """Detections of every readable image under ``inputs`` (DICOM files or folders), exam
        by exam; problems go to ``report`` (a fresh one, logged only, when None)."""
        report = report if report is not None else BadInputReport("predict")
        return [p for _, preds in self.predict_exams(self.exams(inputs, report), report)
                for p in preds]
