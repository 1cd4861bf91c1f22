"""DICOM Structured Report results of one exam with highdicom (TID 1500 Measurement Report).

One Comprehensive SR per exam (our choice of layout; the paper has no output format):

* one TID 1410 planar-ROI group per detected box: the region is a closed SCOORD POLYLINE (the
  box's 4 corners, first = last) in the ORIGINAL pixel grid of its source image (column, row;
  (0, 0) = top-left corner of the top-left pixel, detectron2's XYXY convention), referencing
  that image by SOP Class/Instance UID; finding type "Lesion", finding site breast + laterality,
  the score as the measurement (DCM 111047) "Probability of cancer" (unit "1");
* one TID 1501 group per breast and one for the exam with the breast / exam malignancy score
  (``evaluation/exam_scores.py``), tracking identifiers "breast L", "breast R", "exam";
* the algorithm (name, version, score threshold) in every measurement.

``image_presentation_state``: a Grayscale Softcopy Presentation State per image (highdicom.pr)
so that PACS viewers draw the same boxes (POLYLINE, PIXEL units) with their scores as text.

The SR and the presentation states are the outputs that carry the patient and study identity of
their source images (highdicom copies the patient / study modules of the (first) image): a PACS
files them beside the images. ``pseudonyms`` (a ``PseudonymMap``, research) de-identifies the
source headers first (PS3.15 Basic Profile, ``inference/deidentify.py``), so the SR and every
presentation state of a study carry one pseudonym and the same replacement UIDs.

Each presentation state carries its image's Laterality (General Series, Type 2C) and, for a
MONOCHROME1 image, Presentation LUT Shape INVERSE (IDENTITY would show it as a negative).
The writers read the source headers (``read_source_header``); a header that is gone or not
DICOM raises, and the caller writes the SR of the other images (``inference/outputs.py``).
"""
import warnings
from typing import Dict, List, Sequence

import highdicom as hd
import numpy as np
import pydicom
from pydicom.sr.codedict import codes

__all__ = ["ALGORITHM", "exam_sr", "image_presentation_state", "read_source_header",
           "read_sr_findings"]

ALGORITHM = "BRAIxDet"
_SCORE = codes.DCM.ProbabilityOfCancer
_LATERALITY = {"L": codes.SCT.Left, "R": codes.SCT.Right}


# Type 2 patient / study attributes highdicom copies from the first image: empty when absent
_TYPE2 = ("PatientID", "PatientName", "PatientBirthDate", "PatientSex", "AccessionNumber",
          "StudyID", "StudyDate", "StudyTime", "ReferringPhysicianName")


def read_source_header(path, pseudonyms=None, patient=None):
    """The header the writers copy from (de-identified with ``pseudonyms``, as the patient of
    the header ``patient``, default its own); OSError / InvalidDicomError when the file is
    gone or not DICOM."""
    ds = pydicom.dcmread(path, stop_before_pixels=True)
    for keyword in _TYPE2:
        if keyword not in ds:
            setattr(ds, keyword, "")
    return pseudonyms.header(ds, patient) if pseudonyms is not None else ds


def _sources(images, pseudonyms):
    """The images' headers: given (``header``) or read from ``path`` and de-identified as
    the patient of the first image (one pseudonym per exam)."""
    raw = [im["header"] if im.get("header") is not None else read_source_header(im["path"])
           for im in images]
    if pseudonyms is None:
        return raw
    return [im["header"] if im.get("header") is not None else pseudonyms.header(ds, raw[0])
            for im, ds in zip(images, raw)]


def _version():
    try:
        from importlib.metadata import version

        return version("braixdet")
    except Exception:  # not installed as a distribution (run from the source tree)
        return "0"


def _score(value, algorithm, site=None):
    return hd.sr.Measurement(name=_SCORE, value=float(value), unit=codes.UCUM.NoUnits,
                             algorithm_id=algorithm, finding_sites=site)


def _site(laterality):
    return [hd.sr.FindingSite(anatomic_location=codes.SCT.Breast,
                              laterality=_LATERALITY[laterality])]


def exam_sr(images: Sequence[dict], breast_scores: Dict[str, float], exam_score: float, *,
            score_thresh: float, series_number: int = 9001, pseudonyms=None
            ) -> hd.sr.ComprehensiveSR:
    """The SR of one exam. ``images``: one dict per source image with ``path`` (its DICOM file)
    or ``header`` (``read_source_header``), ``laterality`` ("L"/"R"), ``boxes`` ((N, 4) XYXY
    original pixels) and ``scores`` (N,); boxes scoring below ``score_thresh`` are left out.
    ``breast_scores``: {"L"/"R": score}. ``pseudonyms``: a ``PseudonymMap`` (module doc)."""
    headers = _sources(images, pseudonyms)
    algorithm = hd.sr.AlgorithmIdentification(name=ALGORITHM, version=_version(),
                                              parameters=[f"score_thresh={score_thresh:g}"])
    groups = []
    for im, ds in zip(images, headers):
        source = hd.sr.SourceImageForRegion.from_source_image(ds)
        boxes = np.asarray(im["boxes"], dtype=np.float64).reshape(-1, 4)
        scores = np.asarray(im["scores"], dtype=np.float64).reshape(-1)
        for k, ((x0, y0, x1, y1), s) in enumerate(zip(boxes, scores)):
            if s < score_thresh:
                continue
            corners = np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1], [x0, y0]])
            groups.append(hd.sr.PlanarROIMeasurementsAndQualitativeEvaluations(
                tracking_identifier=hd.sr.TrackingIdentifier(
                    uid=hd.UID(), identifier=f"box {k + 1} of {ds.SOPInstanceUID}"[:64]),
                referenced_region=hd.sr.ImageRegion(graphic_type=hd.sr.GraphicTypeValues.POLYLINE,
                                                    graphic_data=corners, source_image=source),
                finding_type=codes.SCT.Lesion, finding_sites=_site(im["laterality"]),
                measurements=[_score(s, algorithm)]))
    for lat in sorted(breast_scores):
        groups.append(hd.sr.MeasurementsAndQualitativeEvaluations(
            tracking_identifier=hd.sr.TrackingIdentifier(uid=hd.UID(), identifier=f"breast {lat}"),
            finding_type=codes.SCT.Breast, finding_sites=_site(lat),
            measurements=[_score(breast_scores[lat], algorithm)]))
    groups.append(hd.sr.MeasurementsAndQualitativeEvaluations(
        tracking_identifier=hd.sr.TrackingIdentifier(uid=hd.UID(), identifier="exam"),
        finding_type=codes.SCT.Breast, measurements=[_score(exam_score, algorithm)]))
    observer = hd.sr.ObserverContext(
        observer_type=codes.DCM.Device,
        observer_identifying_attributes=hd.sr.DeviceObserverIdentifyingAttributes(
            uid=hd.UID(), name=ALGORITHM))
    report = hd.sr.MeasurementReport(
        observation_context=hd.sr.ObservationContext(observer_device_context=observer),
        procedure_reported=codes.SCT.Mammography, imaging_measurements=groups)
    with warnings.catch_warnings():
        # highdicom's check of PatientName warns WITH the name in the text: keep it out of logs
        warnings.filterwarnings("ignore", message="The string .* person name")
        sr = hd.sr.ComprehensiveSR(
            evidence=headers, content=report, series_instance_uid=hd.UID(),
            series_number=series_number, sop_instance_uid=hd.UID(), instance_number=1,
            manufacturer=ALGORITHM, series_description="BRAIxDet detections")
    if pseudonyms is not None:
        pseudonyms.mark(sr)
    return sr


def image_presentation_state(path, boxes, scores, *, score_thresh: float, laterality: str = "",
                             series_number: int = 9002, header=None, pseudonyms=None
                             ) -> hd.pr.GrayscaleSoftcopyPresentationState:
    """GSPS of one image (``path``, or its ``header`` from ``read_source_header``): its boxes
    >= ``score_thresh`` as closed polylines in pixel units, each with its score as a text label
    above it (layer "BRAIXDET", red). ``laterality``: the resolved side ("L"/"R"; default: the
    image's Laterality or ImageLaterality tag)."""
    (ds,) = _sources([{"path": path, "header": header}], pseudonyms)
    layer = hd.pr.GraphicLayer(layer_name="BRAIXDET", order=1, description="detections",
                               display_color=hd.color.CIELabColor(53.2, 80.1, 67.2))  # red
    graphics, texts = [], []
    for (x0, y0, x1, y1), s in zip(np.asarray(boxes, dtype=np.float64).reshape(-1, 4),
                                   np.asarray(scores, dtype=np.float64).reshape(-1)):
        if s < score_thresh:
            continue
        graphics.append(hd.pr.GraphicObject(
            graphic_type=hd.pr.GraphicTypeValues.POLYLINE, units="PIXEL",
            graphic_data=np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1], [x0, y0]])))
        texts.append(hd.pr.TextObject(text_value=f"{s:.2f}", units="PIXEL",
                                      anchor_point=(float(x0), float(max(y0 - 1.0, 0.0))),
                                      anchor_point_visible=False))
    annotations = [hd.pr.GraphicAnnotation(referenced_images=[ds], graphic_layer=layer,
                                           graphic_objects=graphics, text_objects=texts)
                   ] if graphics else None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The string .* person name")
        pr = hd.pr.GrayscaleSoftcopyPresentationState(
            referenced_images=[ds], series_instance_uid=hd.UID(), series_number=series_number,
            sop_instance_uid=hd.UID(), instance_number=1, manufacturer=ALGORITHM,
            manufacturer_model_name=ALGORITHM, software_versions=_version(),
            device_serial_number="0", content_label="BRAIXDET",
            content_description="BRAIxDet detections", graphic_annotations=annotations,
            graphic_layers=[layer], presentation_lut_transformation=_presentation_lut(ds))
    side = laterality or ds.get("Laterality", "") or ds.get("ImageLaterality", "")
    if side in ("L", "R"):  # General Series Type 2C for a paired body part (PS3.3 C.7.3.1)
        pr.Laterality = side
    if pseudonyms is not None:
        pseudonyms.mark(pr)
    return pr


def _presentation_lut(ds):
    """INVERSE for MONOCHROME1 (low values bright), else IDENTITY (PS3.3 C.11.6)."""
    inverse = str(ds.get("PhotometricInterpretation", "")).strip() == "MONOCHROME1"
    return hd.PresentationLUTTransformation(
        presentation_lut_shape=hd.PresentationLUTShapeValues.INVERSE if inverse
        else hd.PresentationLUTShapeValues.IDENTITY)


def read_sr_findings(sr) -> List[dict]:
    """The boxes of an SR written by ``exam_sr`` (a path, a Dataset or a highdicom SR):
    [{"sop_instance_uid", "sop_class_uid", "box_xyxy", "score"}] in content order."""
    if not isinstance(sr, hd.sr.ComprehensiveSR):
        ds = pydicom.dcmread(sr) if not isinstance(sr, pydicom.Dataset) else sr
        sr = hd.sr.ComprehensiveSR.from_dataset(ds)
    out = []
    for group in sr.content.get_planar_roi_measurement_groups():
        region = group.roi
        points = region.value
        ref = region.ContentSequence[0].ReferencedSOPSequence[0]  # its SELECTED FROM image
        (score,) = [m.value for m in group.get_measurements(name=_SCORE)]
        out.append({"sop_instance_uid": str(ref.ReferencedSOPInstanceUID),
                    "sop_class_uid": str(ref.ReferencedSOPClassUID),
                    "box_xyxy": [float(points[:, 0].min()), float(points[:, 1].min()),
                                 float(points[:, 0].max()), float(points[:, 1].max())],
                    "score": float(score)})
    return out
