"""Ipsilateral view pairing (docs/DESIGN.md §2.3): every image is main once; its aux is the other
view (CC <-> MLO) of the same breast in the same exam."""
import collections

from .views import normalize_view


def pair_views(dicts, report=None):
    """Set ``aux_file_name``, ``aux_image_id`` and ``aux_missing`` on each dict, in place.

    Groups by (patient_id, exam_id, laterality). Several candidates for the other view (repeat
    acquisitions) -> the first by image_id (deterministic). No candidate -> aux = main,
    ``aux_missing=True``, counted as ``aux_missing`` in the report.
    """
    groups = collections.defaultdict(lambda: {"CC": [], "MLO": []})
    for d in dicts:
        view = normalize_view(d["view"])
        if view is not None:
            groups[(d["patient_id"], d["exam_id"], d["laterality"])][view].append(d)
    for d in dicts:
        view = normalize_view(d["view"])
        other = "MLO" if view == "CC" else "CC"
        cands = groups[(d["patient_id"], d["exam_id"], d["laterality"])][other] if view else []
        if cands:
            aux = min(cands, key=lambda c: c["image_id"])
            d["aux_file_name"], d["aux_image_id"], d["aux_missing"] = (
                aux["file_name"], aux["image_id"], False)
        else:
            d["aux_file_name"], d["aux_image_id"], d["aux_missing"] = (
                d["file_name"], d["image_id"], True)
            if report is not None:
                report.count("aux_missing")
    return dicts
