"""De-identification of the SR and presentation states (``--sr-pseudonymise``): DICOM PS3.15
Annex E, Basic Application Level Confidentiality Profile, applied to the source headers the
writers copy from (``inference/sr.py``).

* Patient: a RANDOM pseudonym per patient (PatientID ``BXD-<16 hex>``, PatientName
  ``BRAIXDET^<same hex>``, never empty: viewers refuse an empty name), kept in a mapping file
  that the user owns (JSON, mode 0600, outside ``--out``). Nothing about the pseudonym can be
  computed from the PatientID: only the mapping file links them.
* UIDs: every instance UID (study, series, SOP instance, frame of reference, ...; every UI value
  that is not a UID of the DICOM standard) is replaced by a random ``2.25.<uuid>`` UID, the same
  one for the same source UID in the SR and in every presentation state, in this run and in later
  runs with the same mapping file; the standard's UIDs (SOP classes, ...) are kept.
* Removed (Type 3) or emptied (Type 2): the attributes of ``_REMOVE`` / ``_EMPTY`` below, all
  other patient-module (group 0010) attributes and all private tags.
* Added: PatientIdentityRemoved YES, DeidentificationMethod and its code (DCM 113100).

Kept: laterality, view, image size, the detections and scores, the dates of our own content.
"""
import copy
import json
import os
import secrets

import pydicom
from filelock import FileLock
from pydicom._uid_dict import UID_dictionary
from pydicom.sr.codedict import codes
from pydicom.uid import generate_uid

from ..utils.io import atomic_write_text, refuse_link

__all__ = ["PseudonymMap"]

# PS3.15 Table E.1-1 actions for the attributes the writers copy (Z: empty, X: remove)
_EMPTY = ("PatientBirthDate", "PatientSex", "AccessionNumber", "ReferringPhysicianName",
          "StudyID", "StudyDate", "StudyTime")
_REMOVE = ("StudyDescription", "SeriesDescription", "InstitutionName", "InstitutionAddress",
           "InstitutionalDepartmentName", "StationName", "OperatorsName",
           "PerformingPhysicianName", "NameOfPhysiciansReadingStudy", "RequestingPhysician",
           "PhysiciansOfRecord", "AdmittingDiagnosesDescription", "DeviceSerialNumber",
           "ProtocolName", "RequestAttributesSequence", "ReferencedStudySequence",
           "ReferencedPatientSequence", "ReferencedPerformedProcedureStepSequence",
           "ProcedureCodeSequence", "AdditionalPatientHistory", "MedicalAlerts", "Allergies",
           "EthnicGroup", "Occupation", "PatientComments", "ContentCreatorName",
           "IssuerOfAccessionNumberSequence", "InstanceCreatorUID", "TimezoneOffsetFromUTC")
_KEEP_PATIENT = ("PatientID", "PatientName", "PatientBirthDate", "PatientSex",
                 "PatientIdentityRemoved", "DeidentificationMethod",
                 "DeidentificationMethodCodeSequence")
METHOD = "PS3.15 Basic Profile; BRAIxDet random pseudonyms"  # LO: <= 64 characters


class PseudonymMap:
    """The user's mapping file: {"patients": {source PatientID: pseudonym hex},
    "uids": {source UID: replacement}}. ``save()`` after new entries (atomic, mode 0600);
    concurrent runs sharing one file are serialised by a lock next to it."""

    def __init__(self, path, out_dir=None):
        self.path = os.path.abspath(os.fspath(path))
        if out_dir is not None:
            out = os.path.realpath(out_dir)
            if os.path.realpath(self.path).startswith(out + os.sep):
                raise ValueError(f"pseudonym map {self.path} is inside --out {out}: the mapping "
                                 "re-identifies patients; keep it where only you can read it")
        refuse_link(self.path)
        self._lock = FileLock(self.path + ".lock")
        self._lock.acquire()
        try:
            self.data = {"patients": {}, "uids": {}}
            if os.path.exists(self.path):
                with open(self.path, encoding="utf-8") as f:
                    data = json.load(f)
                if not (isinstance(data, dict) and isinstance(data.get("patients"), dict)
                        and isinstance(data.get("uids"), dict)):
                    raise ValueError(f"pseudonym map {self.path}: not a mapping written by "
                                     "BRAIxDet (needs 'patients' and 'uids')")
                self.data = data
        except BaseException:
            self._lock.release()
            raise
        self._dirty = False

    def close(self):
        self.save()
        self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def save(self):
        if self._dirty:
            atomic_write_text(self.path, json.dumps(self.data, indent=1))
            os.chmod(self.path, 0o600)
            self._dirty = False

    def patient(self, ds) -> str:
        """The random pseudonym (hex) of ``ds``'s patient; a header without PatientID is its
        own patient per study (two such patients never share a pseudonym)."""
        key = str(ds.get("PatientID", "") or "") or "study:" + str(ds.get("StudyInstanceUID", ""))
        return self.patient_key(key)

    def patient_key(self, key: str) -> str:
        if key not in self.data["patients"]:
            self.data["patients"][key] = secrets.token_hex(8)
            self._dirty = True
        return self.data["patients"][key]

    def uid(self, value: str) -> str:
        if value in UID_dictionary or not value:  # the standard's UIDs: not identifying
            return value
        if value not in self.data["uids"]:
            self.data["uids"][value] = generate_uid(prefix=None)  # 2.25.<random 128 bit>
            self._dirty = True
        return self.data["uids"][value]

    def header(self, ds: pydicom.Dataset, patient=None) -> pydicom.Dataset:
        """A de-identified copy of a source header (module doc); the writers copy from it.
        ``patient``: the header whose patient it is (default ``ds``), e.g. the exam's first
        image, so that one exam's SR and presentation states share one pseudonym."""
        hexid = self.patient(ds if patient is None else patient)
        ds = copy.deepcopy(ds)
        ds.remove_private_tags()

        def remap(d, elem):
            if elem.VR == "UI" and elem.value:
                values = elem.value if elem.VM > 1 else [elem.value]
                new = [self.uid(str(v)) for v in values]
                elem.value = new if elem.VM > 1 else new[0]
        ds.walk(remap)
        for elem in list(ds):
            if elem.tag.group == 0x0010 and elem.keyword not in _KEEP_PATIENT:
                del ds[elem.tag]
        for keyword in _REMOVE:
            if keyword in ds:
                delattr(ds, keyword)
        for keyword in _EMPTY:
            setattr(ds, keyword, "")
        ds.PatientID = f"BXD-{hexid}"
        ds.PatientName = f"BRAIXDET^{hexid}"
        return ds

    @staticmethod
    def mark(ds: pydicom.Dataset):
        """Record the de-identification in a written SR / presentation state."""
        ds.PatientIdentityRemoved = "YES"
        ds.DeidentificationMethod = METHOD
        item = pydicom.Dataset()
        code = codes.DCM.BasicApplicationConfidentialityProfile
        item.CodeValue, item.CodingSchemeDesignator, item.CodeMeaning = \
            code.value, code.scheme_designator, code.meaning
        ds.DeidentificationMethodCodeSequence = [item]
