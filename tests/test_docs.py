"""The documentation stays true to the repository: no stale names, a README a user reads top to
bottom, links that resolve, and commands, flags, configs and config keys that exist."""
import glob
import os
import re
import subprocess
import unicodedata

import detectron2.engine.defaults
import pytest
from detectron2.config import get_cfg

from braixdet.config import add_braixdet_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
MAX_README_LINES = 220
# Names nothing in the project writes or reads any more; split so this file does not hold them.
STALE_NAMES = ["model_final" + "_teacher.pth"]
# Every markdown file a user is pointed to.
DOCS = ["README.md", "CHANGELOG.md", "datasets/README.md", "benchmarks/README.md",
        "projects/BRAIxDet/README.md"] + sorted(
    os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
SKIP_DIRS = {".git", ".venv", "out", "output", "build", "dist", "__pycache__", ".pytest_cache",
             ".ruff_cache"}


def _read(rel):
    with open(os.path.join(REPO, rel), encoding="utf-8") as f:
        return f.read()


def _tracked_files():
    """Tracked files (git), else every file outside build/venv/output folders (no git)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                             check=True, timeout=30).stdout
        files = [p for p in out.decode("utf-8", "surrogateescape").split("\0") if p]
        if files:
            return files
    except (OSError, subprocess.SubprocessError):
        pass
    files = []
    for root, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        files += [os.path.relpath(os.path.join(root, n), REPO) for n in names]
    return files


def _strip_code(text):
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _code_blocks(text):
    return re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces -> hyphens."""
    text = re.sub(r"`|\*\*|\*", "", heading.strip()).lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def _anchors(rel):
    slugs, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", _strip_code(_read(rel)), flags=re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def test_no_stale_names_in_tracked_text_files():
    hits = []
    for rel in _tracked_files():
        path = os.path.join(REPO, rel)
        if not os.path.isfile(path) or os.path.islink(path) or os.path.getsize(path) > 4 << 20:
            continue
        with open(path, "rb") as f:
            data = f.read()
        if b"\0" in data:  # binary
            continue
        hits += [f"{rel}: {name}" for name in STALE_NAMES if name.encode() in data]
    assert not hits, "stale names (nothing writes these files):\n" + "\n".join(hits)


def test_code_points_to_readme_sections_that_exist():
    """Comments and docstrings that send a reader to README "<section>" name a real heading."""
    headings = {h.strip().lower() for h in re.findall(
        r"^#{1,6} (.+)$", _strip_code(_read("README.md")), flags=re.M)}
    stale = []
    for rel in _tracked_files():
        if not rel.endswith((".py", ".yaml", ".cfg", ".toml")) or rel == "tests/test_docs.py":
            continue
        path = os.path.join(REPO, rel)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for name in re.findall(r"README(?:'s)? \"([^\"]+)\"", text):
            if name.strip().lower() not in headings:
                stale.append(f'{rel}: README "{name}"')
    assert not stale, "references to README sections that do not exist:\n" + "\n".join(stale)


def test_readme_is_short():
    n = len(_read("README.md").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES})"


def test_github_slug_rule():
    assert _slug("8. Departures from the paper, and our choices") == \
        "8-departures-from-the-paper-and-our-choices"
    assert _slug("3.5 GradCAM pseudo-boxes (Algorithm 1)") == "35-gradcam-pseudo-boxes-algorithm-1"
    assert _slug("Protocols (paper §4.2)") == "protocols-paper-42"
    assert _slug("CBIS-DDSM (`cbis_ddsm`)") == "cbis-ddsm-cbis_ddsm"


@pytest.mark.parametrize("rel", DOCS)
def test_relative_links_resolve(rel):
    assert os.path.isfile(os.path.join(REPO, rel)), f"{rel} is missing"
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _strip_code(_read(rel))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(rel), path)) if path else rel
        if not os.path.exists(os.path.join(REPO, dest)):
            broken.append(f"{target} (no file {dest})")
        elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest})")
    assert not broken, f"{rel}: broken links:\n" + "\n".join(broken)


def _commands(text):
    """Shell commands of the README's code blocks, continuation lines joined."""
    cmds = []
    for block in _code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s#", line, maxsplit=1)[0].strip()
            if line:
                cmds.append(line)
    return cmds


def test_readme_scripts_flags_and_configs_exist():
    text = _read("README.md")
    missing = [p for p in sorted(set(re.findall(r"\b((?:tools|benchmarks)/[\w/.-]+\.py)\b", text)))
               if not os.path.isfile(os.path.join(REPO, p))]
    missing += [p for p in sorted(set(re.findall(r"\b(configs/[\w/.-]+\.yaml)\b", text)))
                if not os.path.isfile(os.path.join(REPO, p))]
    # the configs table names files relative to configs/ (brace and glob rows expanded)
    for cell in re.findall(r"^\| `([^`]+\.yaml)` \|", text, flags=re.M):
        m = re.match(r"(.*)\{(.*)\}(.*)", cell)
        names = [m.group(1) + x + m.group(3) for x in m.group(2).split(",")] if m else [cell]
        missing += [f"configs/{n}" for n in names if not glob.glob(os.path.join(REPO, "configs", n),
                                                                   recursive=True)]
    # every --flag of a `python tools/X.py` command is parsed by a tool or the package (a tool
    # may hand its arguments to another's parser)
    package = "".join(_read(os.path.relpath(p, REPO)) for p in glob.glob(
        os.path.join(REPO, "projects", "BRAIxDet", "braixdet", "**", "*.py"), recursive=True)
        + glob.glob(os.path.join(REPO, "tools", "*.py")))
    with open(detectron2.engine.defaults.__file__, encoding="utf-8") as f:
        package += f.read()  # default_argument_parser (train_net.py)
    for cmd in _commands(text):
        m = re.match(r"python (tools/\w+\.py)\b(.*)", cmd)
        if not m or not os.path.isfile(os.path.join(REPO, m.group(1))):
            continue
        source = _read(m.group(1)) + package
        for flag in re.findall(r"(?<!\S)(--[a-z][\w-]*)", m.group(2)):
            if f'"{flag}"' not in source and f"'{flag}'" not in source and flag != "--help":
                missing.append(f"{m.group(1)} {flag}")
        methods = re.search(r"--methods((?: [a-z_]+)+)", m.group(2))
        missing += [f"{m.group(1)} --methods {name}" for name in
                    (methods.group(1).split() if methods else []) if f'"{name}"' not in source]
    targets = set(re.findall(r"^([\w-]+):", _read("Makefile"), flags=re.M))
    missing += [f"make {t}" for t in sorted(set(re.findall(r"`make (\w+)", text)))
                if t not in targets]
    assert not missing, "README names what does not exist:\n" + "\n".join(missing)


def test_config_keys_named_in_docs_exist():
    cfg = get_cfg()
    add_braixdet_config(cfg)
    unknown = []
    for rel in ["README.md", "datasets/README.md"] + [d for d in DOCS if d.startswith("docs/")]:
        text = _read(rel)
        for key in sorted(set(re.findall(r"(?<![\w.])([A-Z][A-Z0-9_]*(?:\.[A-Z][A-Z0-9_]*)+)"
                                         r"(?![\w.]*\()", text))):
            node = cfg
            for part in key.split("."):
                if not isinstance(node, dict) or part not in node:
                    unknown.append(f"{rel}: {key}")
                    break
                node = node[part]
    assert not unknown, "config keys that do not exist:\n" + "\n".join(unknown)
