"""View, laterality and exam of a mammogram: names, the DICOM resolver and the views-CSV override.

One module for the dataset loaders (``data/datasets/*``, through ``normalize_view`` /
``normalize_laterality`` and ``read_dicom_meta``) and the predictor (``read_metas`` /
``group_exams``), so training and inference read views the same way. It imports nothing of the
package, so datasets/common.py, pairing.py and dicom.py can all import it at the top.

Resolver order (first source that names a view wins; docs: datasets/README.md):

* view: ViewPosition -> ViewCodeSequence (SNOMED CT codes of CID 4014, legacy SRT codes, else
  the code meaning) with its ViewModifierCodeSequence (CID 4015) -> PatientOrientation when it
  holds a view name (CBIS-DDSM writes "CC"/"MLO" there) -> SeriesDescription -> ProtocolName ->
  the CBIS-DDSM PatientID naming (``Mass-Test_P_00173_LEFT_CC``).
* laterality: ImageLaterality -> Laterality -> SeriesDescription -> ProtocolName -> PatientID
  naming.

CC-like views (CC, XCCL, XCCM) are CC; lateral views (MLO, ML, LM, LMO) pair like an MLO
(our choice). Views that are no screening CC/MLO are *refused* with the reason, not guessed:
spot compression and magnification (other scale and field of view than the partner view),
rolled/tangential/cleavage/axillary-tail views (part of the breast), FB/SIO/ISO and specimens.
The coded tags must agree (ViewPosition with ViewCodeSequence, ImageLaterality with
Laterality): when they do not, the image is refused (``resolve_view``).
"""
import codecs
import csv
import io
import os
import re

from .report import BadInputError

_VIEWS = {"CC": "CC", "XCCL": "CC", "XCCM": "CC", "XCC": "CC", "CCID": "CC",
          "MLO": "MLO", "ML": "MLO", "LM": "MLO", "LMO": "MLO", "MLOID": "MLO"}
_LATERALITIES = {"L": "L", "LEFT": "L", "R": "R", "RIGHT": "R"}
# ViewPosition / description words of views we refuse (value -> why)
_REFUSED_VIEWS = {
    "FB": "from-below (caudo-cranial) view", "SIO": "superolateral-inferomedial oblique view",
    "ISO": "inferomedial-superolateral oblique view", "AT": "axillary tail view",
    "CV": "cleavage view", "RL": "rolled view", "RM": "rolled view", "RI": "rolled view",
    "RS": "rolled view", "TAN": "tangential view", "SPOT": "spot compression view",
    "MAG": "magnification view", "M": "magnification view", "MAGNIFICATION": "magnification view",
    "SPECIMEN": "specimen radiograph",
}

# ViewCodeSequence: SNOMED CT (CID 4014) and the legacy SRT codes of older modalities.
_VIEW_CODES = {
    "399162004": "CC", "R-10242": "CC",  # cranio-caudal
    "399192008": "CC", "R-1024A": "CC",  # XCCL
    "399101009": "CC", "R-1024B": "CC",  # XCCM
    "399368009": "MLO", "R-10226": "MLO",  # medio-lateral oblique
    "399260004": "MLO", "R-10224": "MLO",  # medio-lateral
    "399352003": "MLO", "R-10228": "MLO",  # latero-medial
    "399099002": "MLO", "R-10230": "MLO",  # latero-medial oblique
}
_REFUSED_VIEW_CODES = {
    "399196006": "caudo-cranial (FB) view",
    "441555000": "inferomedial-superolateral oblique view",
    "399188001": "superolateral-inferomedial oblique view",
    "127457009": "specimen radiograph",
}
# ViewModifierCodeSequence (CID 4015): modifiers that make the image no screening view. Implant
# displaced, nipple in profile, anterior compression, infra-mammary fold and axillary tissue
# still show the whole breast and are accepted (our choice).
_REFUSED_MODIFIER_CODES = {
    "399055006": "spot compression", "399163009": "magnification", "399110001": "tangential",
    "399161006": "cleavage", "399011000": "axillary tail", "399197002": "rolled",
    "399226006": "rolled", "414493004": "rolled", "415670009": "rolled",
}
_REFUSED_MODIFIER_WORDS = ("spot", "magnification", "tangential", "cleavage", "axillary tail",
                           "rolled")

# CBIS-DDSM PatientID: <Mass|Calc>-<Training|Test>_P_<nnnnn>_<LEFT|RIGHT>_<CC|MLO>[_<n>]
CBIS_PATIENT_ID = re.compile(
    r"^(?:Mass|Calc)-(?:Training|Test)_(P_\d+)_(LEFT|RIGHT)_(CC|MLO)(?:_\d+)?$", re.IGNORECASE)
# "L CC", "RMLO", "Left MLO", ... in a series description or protocol name
_LAT_VIEW_WORD = re.compile(r"^(L|R|LEFT|RIGHT)(CC|MLO|XCCL|XCCM|ML|LM|LMO)$")


def normalize_view(view):
    """'CC'/'MLO' (ML/LM/LMO -> MLO), or None when not a CC/MLO-like view."""
    return _VIEWS.get(str(view).strip().upper())


def normalize_laterality(lat):
    """'L'/'R' from L/R/LEFT/RIGHT, or None."""
    return _LATERALITIES.get(str(lat).strip().upper())


def patient_stem(raw_patient_id):
    """The patient part of a PatientID: ``P_00173`` of CBIS-DDSM's per-view IDs, else the ID."""
    raw = str(raw_patient_id or "").strip()
    m = CBIS_PATIENT_ID.match(raw)
    return m.group(1).upper() if m else raw


class ViewResolution:
    """Result of ``resolve_view``: ``view``/``laterality`` ('CC'/'MLO', 'L'/'R' or None),
    ``refused`` (why the view is no screening CC/MLO, or ""), ``conflict`` (two coded tags
    that disagree, or ""), and ``tried``: the tags looked at, each with what was found there,
    WITHOUT tag values (they may hold identifiers)."""

    __slots__ = ("view", "laterality", "refused", "conflict", "conflict_kind", "view_source",
                 "laterality_source", "tried")

    def __init__(self):
        self.view = self.laterality = None
        self.refused = self.conflict = self.conflict_kind = ""
        self.view_source = self.laterality_source = ""
        self.tried = []

    @property
    def problem(self):
        """The report reason of an image without a usable view and side, or ""."""
        if self.refused:
            return "refused_view"
        if self.conflict:
            return self.conflict_kind
        return "unknown_view" if self.view is None or self.laterality is None else ""

    def note(self):
        """One line for the bad-input report of an image without a usable view/laterality."""
        if self.refused:
            return f"refused: {self.refused}"
        if self.conflict:
            return f"refused: {self.conflict} (tags that disagree are not guessed)"
        missing = [w for w, v in (("view", self.view), ("laterality", self.laterality)) if not v]
        return f"no {' and '.join(missing)}; tried " + ", ".join(self.tried)


def _text(ds, keyword):
    try:
        v = ds.get(keyword, None)
    except Exception:  # noqa: BLE001 - a malformed optional tag is as good as absent
        return ""
    if v is None:
        return ""
    if not isinstance(v, (str, bytes)) and hasattr(v, "__len__"):  # MultiValue
        v = "\\".join(str(x) for x in v)
    return str(v).strip()


def _words(text):
    return [w for w in re.split(r"[^A-Z0-9]+", text.upper()) if w]


def _from_code_sequence(ds):
    """(view or None, refused reason or "", what was found) from ViewCodeSequence."""
    try:
        return _read_code_sequence(ds)
    except Exception:  # noqa: BLE001 - a malformed sequence names no view; the rest decides
        return None, "", "malformed"


def _read_code_sequence(ds):
    seq = ds.get("ViewCodeSequence", None) or []
    if not seq:
        return None, "", "absent"
    item = seq[0]
    for mod in item.get("ViewModifierCodeSequence", None) or []:
        code = str(mod.get("CodeValue", "")).strip()
        meaning = str(mod.get("CodeMeaning", "")).lower()
        if code in _REFUSED_MODIFIER_CODES:
            return None, f"ViewModifierCodeSequence {_REFUSED_MODIFIER_CODES[code]}", "refused"
        for w in _REFUSED_MODIFIER_WORDS:
            if w in meaning:
                return None, f"ViewModifierCodeSequence {w}", "refused"
    code = str(item.get("CodeValue", "")).strip()
    if code in _VIEW_CODES:
        return _VIEW_CODES[code], "", "found"
    if code in _REFUSED_VIEW_CODES:
        return None, f"ViewCodeSequence {_REFUSED_VIEW_CODES[code]}", "refused"
    meaning = str(item.get("CodeMeaning", "")).lower().replace(" ", "-")
    if "cranio-caudal" in meaning:
        return "CC", "", "found"
    if "medio-lateral" in meaning or "latero-medial" in meaning:
        return "MLO", "", "found"
    return None, "", "unknown code"


def _from_words(text, keyword):
    """(view, laterality, refused) from the words of a description: 'L CC', 'RMLO', ..."""
    views, lats, lone, refused = set(), set(), set(), ""
    for w in _words(text):
        m = _LAT_VIEW_WORD.match(w)
        if m:
            lats.add(_LATERALITIES[m.group(1)])
            views.add(_VIEWS[m.group(2)])
        elif w in _VIEWS:
            views.add(_VIEWS[w])
        elif w in _LATERALITIES:
            (lats if len(w) > 1 else lone).add(_LATERALITIES[w])
        elif w in _REFUSED_VIEWS and len(w) > 2:
            refused = f"{keyword} says {_REFUSED_VIEWS[w]}"
        elif w in ("MASK", "CROPPED", "ROI"):  # CBIS-DDSM ROI masks and lesion crops
            refused = f"{keyword} says ROI mask or cropped image"
    if views and not lats:  # a lone 'L'/'R' counts only next to a view name ("R MLO")
        lats = lone
    # two different views (or sides) named: the text does not describe one image
    return (views.pop() if len(views) == 1 else None,
            lats.pop() if len(lats) == 1 else None, refused)


def resolve_view(ds):
    """View and laterality of one DICOM dataset (anything with ``.get(keyword)``), in the
    documented order; see the module doc. Conflict rules (docs/DESIGN.md §7a):

    * ViewPosition and ViewCodeSequence naming different views (CC vs MLO): ``view_conflict``;
      ImageLaterality and Laterality naming different sides: ``laterality_conflict``; the
      image is refused (no view / side), not decided by the order;
    * a refusing ViewModifierCodeSequence (spot compression, magnification, ...) or a refusing
      word in SeriesDescription / ProtocolName refuses the image whatever else names its view
      (a spot view whose ViewPosition says CC is still a spot view).
    """
    r = ViewResolution()

    def view_found(view, source):
        if r.view is None and view:
            r.view, r.view_source = view, source

    def lat_found(lat, source):
        if r.laterality is None and lat:
            r.laterality, r.laterality_source = lat, source

    pos = _text(ds, "ViewPosition").upper()
    pos_view = _VIEWS.get(pos)
    if pos in _REFUSED_VIEWS:
        r.refused = f"ViewPosition {_REFUSED_VIEWS[pos]}"
    r.tried.append("ViewPosition (" + ("absent" if not pos else "found" if pos_view or r.refused
                                        else "no CC/MLO name") + ")")
    code_view, refused, found = _from_code_sequence(ds)  # read always: its modifiers refuse
    r.refused = r.refused or refused
    r.tried.append(f"ViewCodeSequence ({found})")
    if pos_view and code_view and pos_view != code_view:
        r.conflict, r.conflict_kind = (f"ViewPosition names {pos_view}, ViewCodeSequence "
                                       f"{code_view}"), "view_conflict"
    view_found(pos_view, "ViewPosition")
    view_found(code_view, "ViewCodeSequence")
    sides = {}
    for keyword in ("ImageLaterality", "Laterality"):
        text = _text(ds, keyword).upper()
        if text in ("L", "R"):
            sides[keyword] = text
        lat_found(sides.get(keyword), keyword)
        r.tried.append(f"{keyword} (" + ("absent" if not text else "found"
                                         if keyword in sides else "no L/R") + ")")
    if len(set(sides.values())) > 1 and not r.conflict:
        r.conflict, r.conflict_kind = (f"ImageLaterality names {sides['ImageLaterality']}, "
                                       f"Laterality {sides['Laterality']}"), "laterality_conflict"
    if r.view is None:
        orient = _text(ds, "PatientOrientation").upper()
        view_found(_VIEWS.get(orient), "PatientOrientation")
        r.tried.append("PatientOrientation (" + ("absent" if not orient else "found"
                                                 if r.view else "no view name") + ")")
    for keyword in ("SeriesDescription", "ProtocolName"):
        text = _text(ds, keyword)
        view, lat, refused = _from_words(text, keyword)  # read always: refusing words count
        r.refused = r.refused or refused
        if r.view is None or r.laterality is None:
            view_found(view, keyword)
            lat_found(lat, keyword)
            r.tried.append(f"{keyword} ({'absent' if not text else 'read'})")
    if (r.view is None or r.laterality is None) and not r.refused:
        m = CBIS_PATIENT_ID.match(_text(ds, "PatientID"))
        if m:
            view_found(m.group(3).upper(), "PatientID")
            lat_found(_LATERALITIES[m.group(2).upper()], "PatientID")
        r.tried.append("PatientID (" + ("CBIS-DDSM naming" if m else "no CBIS-DDSM naming")
                       + ")")
    if r.refused or r.conflict_kind == "view_conflict":
        r.view = None
    if r.conflict_kind == "laterality_conflict":
        r.laterality = None
    return r


# ----------------------------------------------------------------------- views-CSV override
VIEWS_CSV_COLUMNS = ("file", "laterality", "view", "exam")


class ViewOverrides:
    """``file,laterality,view,exam`` rows of a views CSV (``load_views_csv``). A ``file`` cell
    with a folder part matches that path (relative cells: to the CSV's folder); a bare name
    matches any input file of that basename. Empty cells keep what the DICOM tags say."""

    def __init__(self, by_path, by_name):
        self.by_path, self.by_name = by_path, by_name

    def __len__(self):
        return len(self.by_path) + len(self.by_name)

    def lookup(self, path):
        """The row ``{"laterality", "view", "exam"}`` for an input file, or None."""
        path = os.path.normpath(os.path.abspath(os.fspath(path)))
        row = self.by_path.get(path)
        return row if row is not None else self.by_name.get(os.path.basename(path))


def _decoded_csv(csv_path):
    """The text of a CSV file, decoded as UTF-8 (an optional BOM dropped) before any row is
    parsed: a file that is not UTF-8 is refused in one line naming the first bad byte's offset,
    never read in part."""
    try:
        with open(csv_path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise BadInputError(csv_path, "missing_file", e.strerror or type(e).__name__) from None
    bom = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
    try:
        return raw[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = bom + e.start
        line = raw.count(b"\n", 0, at) + 1
        raise BadInputError(csv_path, "bad_encoding", f"not UTF-8: byte 0x{raw[at]:02x} at "
                            f"offset {at} (line {line}); save the CSV as UTF-8") from None


def load_views_csv(csv_path, report=None):
    """Read a views CSV -> ``ViewOverrides``. A bad row (unknown laterality/view, duplicate
    file, nothing to override) is one ``bad_row`` line naming the CSV and its line number: in
    ``report`` (the row is skipped) or, without a report, raised as ``BadInputError``. A file
    that is not UTF-8 is refused whole (``bad_encoding``, with the byte offset)."""
    def bad(line, detail):
        err = BadInputError(csv_path, "bad_row", f"line {line}: {detail}")
        if report is None:
            raise err
        report.add(err)

    base = os.path.dirname(os.path.abspath(os.fspath(csv_path)))
    by_path, by_name = {}, {}
    reader = csv.reader(io.StringIO(_decoded_csv(csv_path), newline=""))
    try:
        header = [h.strip().lower() for h in next(reader)]
    except (StopIteration, csv.Error):
        header = []
    if tuple(header) != VIEWS_CSV_COLUMNS:
        raise BadInputError(csv_path, "bad_row",
                            f"line 1: header must be {','.join(VIEWS_CSV_COLUMNS)}")
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            bad(reader.line_num, type(e).__name__)
            continue
        line = reader.line_num
        if not any(c.strip() for c in cells):
            continue
        if len(cells) != len(VIEWS_CSV_COLUMNS):
            bad(line, f"{len(cells)} cells, expected {len(VIEWS_CSV_COLUMNS)}")
            continue
        file_cell, lat_cell, view_cell, exam = (c.strip() for c in cells)
        lat, view = normalize_laterality(lat_cell), normalize_view(view_cell)
        if not file_cell or "\0" in file_cell:
            bad(line, "empty or invalid file cell")
        elif lat_cell and lat is None:
            bad(line, "laterality must be L, R, LEFT or RIGHT")
        elif view_cell and view is None:
            bad(line, "view must be CC, MLO or a CC/MLO variant (XCCL, XCCM, ML, LM, LMO)")
        elif not (lat or view or exam):
            bad(line, "nothing to override (laterality, view and exam empty)")
        else:
            named = os.path.basename(file_cell) == file_cell
            key = file_cell if named else os.path.normpath(os.path.join(base, file_cell))
            table = by_name if named else by_path
            if key in table:
                bad(line, "the same file listed twice")
                continue
            table[key] = {"laterality": lat, "view": view, "exam": exam}
    return ViewOverrides(by_path, by_name)
