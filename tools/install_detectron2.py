#!/usr/bin/env python
"""Install detectron2 into the current Python environment, unless it already imports.

Upstream detectron2 publishes no package on the index. `pb1-detectron2==0.6` is the verbatim
upstream v0.6 Python source (without layers/csrc). We download that sdist, verify its sha256,
apply our backport patch (tools/patches/detectron2-0.6-backports.patch) and pip-install it
without dependencies (those are pinned in requirements.txt).

A user who built upstream detectron2 from source keeps it: if `import detectron2` works we stop.
"""
import argparse
import hashlib
import html.parser
import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request

SDIST_NAME = "pb1-detectron2"
SDIST_VERSION = "0.6"
SDIST_FILE = f"{SDIST_NAME}-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "5d2e9e51e523ec72f6a31cca04b0a515492e9514b773a3d134cedc0677170b29"
INDEX_URL = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
PATCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "patches",
                     "detectron2-0.6-backports.patch")


class _LinkParser(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.links.extend(v for k, v in attrs if k == "href")


def find_sdist_url(index_url: str = INDEX_URL) -> str:
    """Resolve the sdist's download URL from a PEP 503 simple index page."""
    page_url = f"{index_url}/{SDIST_NAME}/"
    with urllib.request.urlopen(page_url, timeout=60) as r:
        parser = _LinkParser()
        parser.feed(r.read().decode("utf-8"))
    for href in parser.links:
        if urllib.parse.urlparse(href).path.endswith("/" + SDIST_FILE):
            return urllib.parse.urljoin(page_url, href.split("#")[0])
    raise RuntimeError(f"{SDIST_FILE} not listed on {page_url}")


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_sdist(dest_dir: str, cache_dir: str = None) -> str:
    """Download (or reuse a cached copy of) the sdist and verify its hash."""
    cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "braixdet")
    os.makedirs(cache_dir, exist_ok=True)
    cached = os.path.join(cache_dir, SDIST_FILE)
    if not (os.path.exists(cached) and sha256_of(cached) == SDIST_SHA256):
        url = find_sdist_url()
        print(f"[install_detectron2] downloading {url}", flush=True)
        tmp = cached + ".part"
        urllib.request.urlretrieve(url, tmp)
        digest = sha256_of(tmp)
        if digest != SDIST_SHA256:
            os.remove(tmp)
            raise RuntimeError(f"{SDIST_FILE}: sha256 {digest} != expected {SDIST_SHA256}")
        os.replace(tmp, cached)
    return cached


def unpack_and_patch(sdist: str, workdir: str) -> str:
    """Unpack the sdist into workdir and apply the backport patch; return the source root."""
    with tarfile.open(sdist) as tf:
        tf.extractall(workdir, filter="data")
    root = os.path.join(workdir, f"{SDIST_NAME}-{SDIST_VERSION}")
    subprocess.run(["patch", "-p1", "--forward", "--batch", "-i", PATCH], cwd=root, check=True,
                   stdout=subprocess.DEVNULL)
    return root


MARKER = ".braixdet_backports_sha256"


def patch_sha256() -> str:
    return sha256_of(PATCH)


def installed_state() -> str:
    """'absent', 'current' (our build, this patch), 'stale' (our build, older patch), 'user'."""
    spec = importlib.util.find_spec("detectron2")
    if spec is None or not spec.submodule_search_locations:
        return "absent"
    marker = os.path.join(list(spec.submodule_search_locations)[0], MARKER)
    if not os.path.exists(marker):
        return "user"  # built by the user (e.g. upstream main from source): keep it
    with open(marker) as f:
        return "current" if f.read().strip() == patch_sha256() else "stale"


def write_marker():
    out = subprocess.run([sys.executable, "-c", "import detectron2, os; "
                          "print(os.path.dirname(detectron2.__file__))"],
                         check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(out, MARKER), "w") as f:
        f.write(patch_sha256())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="reinstall even if detectron2 imports")
    args = ap.parse_args(argv)
    state = installed_state()
    if state in ("current", "user") and not args.force:
        print(f"[install_detectron2] detectron2 already importable ({state} build); keeping it")
        return 0
    with tempfile.TemporaryDirectory() as work:
        root = unpack_and_patch(download_sdist(work), work)
        # --no-build-isolation: setup.py imports torch, which is already installed here.
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--no-build-isolation", root], check=True)
    write_marker()
    print("[install_detectron2] installed patched detectron2 0.6")
    return 0


if __name__ == "__main__":
    sys.exit(main())
