"""On-disk cache of canonical images: decode + canonicalise each DICOM once per parameter set.

Layout: ``<cache_dir>/<params.key()>/<h[:2]>/<h>.npy`` (uint16 array; or ``.png``, 16-bit grey, with
``fmt="png"``: about 3x smaller on disk, but decoding it makes a cache hit ~10x slower than
reading the raw array, which is why ``npy`` is the default) + ``<h>.json`` (transform and
preprocessing info), ``h = sha1(abs path | size | mtime_ns | laterality)``, so an edited or
replaced file is recomputed; the sidecar records that source (and the parameter key) and a
read checks both, so another image's entry copied over this one is rebuilt, never used. Writes
are atomic (temp file + ``os.replace``): concurrent data loader workers may compute the same
entry; the last rename wins and readers never see partial files. Nothing is ever written next
to the input.

Every read is validated: the JSON sidecar's structure, the image's header, size, shape, dtype and
a CRC-32 of its pixel data (stored in the sidecar when the entry is written). An entry that fails
any check (truncated or overwritten file, empty or foreign sidecar, entry of an older version
without a checksum) is never used: it is rebuilt from the DICOM, logged on one line naming the
entry and the reason, and counted in ``CanonicalCache.rebuilt`` / ``rebuilt_reasons``.
"""
import collections
import hashlib
import io
import json
import logging
import os
import zlib

import cv2
import numpy as np

from ..utils.io import atomic_write_bytes
from .dicom import read_dicom_image
from .preprocess import PreprocessParams, canonicalize, transform_from_dict, transform_to_dict

__all__ = ["CanonicalCache", "InvalidCacheEntry"]

logger = logging.getLogger(__name__)

_SCALE = 65535.0
# Fast deflate (RLE strategy) without PNG row filters: ~2x faster to decode and ~3x faster to
# encode than the defaults, similar size on masked mammograms (large zero background).
_PNG_PARAMS = [cv2.IMWRITE_PNG_COMPRESSION, 1, cv2.IMWRITE_PNG_FILTER, cv2.IMWRITE_PNG_FILTER_NONE,
               cv2.IMWRITE_PNG_STRATEGY, cv2.IMWRITE_PNG_STRATEGY_RLE]
_MAX_SIDECAR_BYTES = 1 << 20  # ours are < 2 kB; anything larger is not one of ours
_NPY_MAGIC = b"\x93NUMPY"


class InvalidCacheEntry(Exception):
    """A cache entry that must not be used; ``str`` is the reason."""


def _to_float(q):
    out = q.astype(np.float32)
    out *= 1.0 / _SCALE
    return out


def _checksum(q):
    return zlib.crc32(np.ascontiguousarray(q).data) & 0xFFFFFFFF


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


class CanonicalCache:
    def __init__(self, cache_dir, params: PreprocessParams = None, allow_for_processing=False,
                 fmt="npy"):
        if not cache_dir:
            raise ValueError("CanonicalCache needs a cache_dir")
        if fmt not in ("npy", "png"):
            raise ValueError(f"cache format must be 'npy' or 'png', got {fmt!r}")
        self.fmt = fmt
        self.ext = "." + fmt
        self.params = params or PreprocessParams()
        self.root = os.path.join(os.path.abspath(os.fspath(cache_dir)), self.params.key())
        self.allow_for_processing = allow_for_processing
        self.rebuilt = 0  # invalid entries found and rebuilt by this instance (this process)
        self.rebuilt_reasons = collections.Counter()

    @staticmethod
    def source_of(file_name, laterality=None):
        """What an entry is bound to: the DICOM's absolute path, size, mtime and the laterality
        it was canonicalised for (recorded in the sidecar and checked on every read)."""
        path = os.path.abspath(os.fspath(file_name))
        st = os.stat(path)  # FileNotFoundError is handled by the caller (missing_file)
        return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "laterality": (laterality or "").upper()}

    def entry_path(self, file_name, laterality=None, source=None):
        """Path stem (no extension) of the cache entry of this file's current version."""
        src = source or self.source_of(file_name, laterality)
        ident = f"{src['path']}|{src['size']}|{src['mtime_ns']}|{src['laterality']}"
        h = hashlib.sha1(ident.encode("utf-8")).hexdigest()
        return os.path.join(self.root, h[:2], h)

    def has(self, file_name, laterality=None):
        """Whether a complete entry of this file's current version exists (image and sidecar,
        written last; a read still validates it). False for a missing or unreadable file."""
        try:
            stem = self.entry_path(file_name, laterality)
        except OSError:
            return False
        return os.path.exists(stem + ".json") and os.path.exists(stem + self.ext)

    def get(self, file_name, laterality=None):
        """(canonical float32 (H, W) in [0, 1], TransformList original->canonical)."""
        img, tfm, _ = self.get_with_info(file_name, laterality)
        return img, tfm

    def get_with_info(self, file_name, laterality=None, decoded=None):
        """Like ``get`` plus the preprocessing ``info`` dict (flip, crop, disagreement, ...).
        ``decoded``: the ``read_dicom_image`` result the caller already has for this file as it
        is now (the predictor keeps the original for overlays): on a miss the canonical image
        is made from it instead of decoding the file a second time."""
        try:
            source = self.source_of(file_name, laterality)
            stem = self.entry_path(file_name, laterality, source)
        except OSError:
            source = stem = None  # let the reader raise the proper BadInputError
        if stem is not None:
            try:
                hit = self._load(stem, source)
            except InvalidCacheEntry as e:
                self.rebuilt += 1
                self.rebuilt_reasons[str(e).split(":")[0]] += 1
                logger.warning("cache entry %s is invalid (%s): rebuilt from %s", stem, e,
                               file_name)
                hit = None
            if hit is not None:
                return hit
        img, meta = decoded or read_dicom_image(file_name,
                                                allow_for_processing=self.allow_for_processing)
        canonical, tfm, info = canonicalize(img, laterality or meta.laterality, self.params,
                                         name=str(file_name))
        q = np.round(canonical * _SCALE).astype(np.uint16)
        record = {"source": source or self.source_of(file_name, laterality),
                  "transform": transform_to_dict(tfm), "info": info,
                  "height": meta.rows, "width": meta.cols, "params": self.params.key(),
                  "image": {"format": self.fmt, "shape": list(q.shape), "dtype": "uint16",
                            "crc32": _checksum(q)}}
        self._store(stem or self.entry_path(file_name, laterality, record["source"]), q, record)
        # Return the quantised image so cold and warm reads are bit-identical.
        return _to_float(q), tfm, info

    # -- reading --------------------------------------------------------------------------------
    def _load(self, stem, source):
        """(image, transform, info) of a valid entry made from ``source``; None when there is no
        entry; raises InvalidCacheEntry (reason) for anything else."""
        has_json, has_img = os.path.exists(stem + ".json"), os.path.exists(stem + self.ext)
        if not (has_json or has_img):
            return None
        if not (has_json and has_img):
            raise InvalidCacheEntry("incomplete entry: " + ("no image" if has_json else
                                                            "no JSON sidecar"))
        record, tfm = self._read_sidecar(stem + ".json")
        if record.get("source") != source:  # e.g. another image's entry copied over this one
            raise InvalidCacheEntry("foreign entry: made from another file, version or side")
        expect = record["image"]
        q = self._read_npy(stem + ".npy") if self.ext == ".npy" else self._read_png(stem + ".png")
        if list(q.shape) != expect["shape"]:
            raise InvalidCacheEntry(f"wrong shape: {q.shape} vs {tuple(expect['shape'])} in the "
                                    "sidecar")
        if _checksum(q) != expect["crc32"]:
            raise InvalidCacheEntry("checksum mismatch: the image data changed after it was "
                                    "written")
        return _to_float(q), tfm, record["info"]

    def _read_sidecar(self, path):
        try:
            with open(path, "rb") as f:
                raw = f.read(_MAX_SIDECAR_BYTES + 1)
        except OSError as e:
            raise InvalidCacheEntry(f"unreadable sidecar: {e.strerror or e}") from None
        if len(raw) > _MAX_SIDECAR_BYTES:
            raise InvalidCacheEntry("bad sidecar: larger than 1 MB")
        try:
            record = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as e:  # JSONDecodeError / UnicodeDecodeError
            raise InvalidCacheEntry(f"bad sidecar: not JSON ({type(e).__name__})") from None
        if not isinstance(record, dict):
            raise InvalidCacheEntry(f"bad sidecar: a JSON {type(record).__name__}, not an object")
        image = record.get("image")
        if not isinstance(image, dict) or "crc32" not in image:
            raise InvalidCacheEntry("bad sidecar: no checksum (older cache version)")
        h, w = self.params.canonical_size
        if image.get("format") != self.fmt or image.get("dtype") != "uint16" or \
                image.get("shape") != [h, w] or not _is_int(image.get("crc32")):
            raise InvalidCacheEntry(f"bad sidecar: image description {image!r:.120} does not "
                                    f"match {self.fmt} uint16 {h}x{w}")
        if record.get("params") != self.params.key() or not isinstance(record.get("info"), dict):
            raise InvalidCacheEntry("bad sidecar: wrong parameter set or no info")
        t = record.get("transform")
        try:
            tfm = transform_from_dict(t)
            ok = transform_to_dict(tfm) == t  # only the kinds and fields we write
        except Exception:  # noqa: BLE001 - any malformed transform is one invalid entry
            ok = False
        if not ok:
            raise InvalidCacheEntry("bad sidecar: malformed transform")
        return record, tfm

    def _read_npy(self, path):
        h, w = self.params.canonical_size
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise InvalidCacheEntry(f"unreadable image: {e.strerror or e}") from None
        if not data.startswith(_NPY_MAGIC):
            raise InvalidCacheEntry(f"bad npy header: {len(data)}-byte file without the npy "
                                    "magic")
        try:
            buf = io.BytesIO(data)
            version = np.lib.format.read_magic(buf)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}[version]
            shape, fortran, dtype = read_header(buf)
        except Exception as e:  # noqa: BLE001 - ValueError/KeyError/SyntaxError: mangled header
            raise InvalidCacheEntry(f"bad npy header: {type(e).__name__}") from None
        if fortran or dtype != np.dtype(np.uint16) or tuple(shape) != (h, w):
            raise InvalidCacheEntry(f"wrong shape or dtype: {tuple(shape)} {dtype} "
                                    f"(fortran={fortran}) vs ({h}, {w}) uint16")
        offset, nbytes = buf.tell(), h * w * 2
        if len(data) - offset != nbytes:
            raise InvalidCacheEntry(f"wrong size: {len(data) - offset} data bytes, expected "
                                    f"{nbytes}")
        return np.frombuffer(data, dtype=np.uint16, count=h * w, offset=offset).reshape(h, w)

    def _read_png(self, path):
        try:
            q = cv2.imread(path, cv2.IMREAD_UNCHANGED)
        except Exception as e:  # noqa: BLE001 - cv2.error on some corrupt files
            raise InvalidCacheEntry(f"undecodable png: {type(e).__name__}") from None
        if q is None:
            raise InvalidCacheEntry("undecodable png")
        if q.dtype != np.uint16 or q.ndim != 2:
            raise InvalidCacheEntry(f"wrong shape or dtype: {q.shape} {q.dtype}")
        return q

    # -- writing --------------------------------------------------------------------------------
    def _store(self, stem, q, record):
        d = os.path.dirname(stem)
        os.makedirs(d, exist_ok=True)
        # image first, JSON last: the JSON's presence marks a complete entry.
        if self.ext == ".npy":
            buf = io.BytesIO()
            np.save(buf, q, allow_pickle=False)
            atomic_write_bytes(stem + ".npy", buf.getvalue(), fsync=False)
        else:
            ok, png = cv2.imencode(".png", q, _PNG_PARAMS)
            if not ok:
                raise RuntimeError(f"PNG encoding failed for {stem}")
            atomic_write_bytes(stem + ".png", png.tobytes(), fsync=False)
        atomic_write_bytes(stem + ".json", json.dumps(record).encode("utf-8"), fsync=False)
