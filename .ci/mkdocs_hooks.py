"""MkDocs hook: serve the diagram script (mermaid) with the site instead of from a CDN.

Material for MkDocs renders ```` ```mermaid ```` fences in the browser with mermaid's
script, which it fetches from unpkg.com unless ``window.mermaid`` is already defined. Offline
(our machines, readers behind a proxy) that fetch fails and a diagram shows as raw text. This
hook takes ``dist/mermaid.min.js`` from the npm registry's ``mermaid`` package, pinned to one
version and checked against the registry's sha512 integrity hash, adds it to the site as
``javascripts/vendor/mermaid.min.js`` and loads it, before Material's bundle, on the pages
that have a diagram (the others do not download its 3.5 MB). With Material's
``navigation.instant`` (off here) a page reached in place would not get the script: list it
in ``extra_javascript`` instead if that feature is turned on.

The tarball is downloaded once into ``.cache/docs/`` (git-ignored; ``AIOEP_DOCS_CACHE``
moves it). Without network access, put the tarball there or point ``AIOEP_MERMAID_TARBALL``
at a copy: it is checked against the same hash either way.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page
from mkdocs.utils import get_relative_url

# Material for MkDocs 9.x loads mermaid@11 (its bundle names unpkg.com/mermaid@11): keep the
# major it expects. Upgrading: `npm view mermaid@<version> dist.integrity`.
MERMAID_VERSION = "11.17.2"
# NPM_CONFIG_REGISTRY (npm's setting) picks a mirror; the hash holds whatever serves it.
_REGISTRY = (os.environ.get("NPM_CONFIG_REGISTRY") or "https://registry.npmjs.org/").rstrip("/")
MERMAID_TARBALL = f"{_REGISTRY}/mermaid/-/mermaid-{MERMAID_VERSION}.tgz"
MERMAID_INTEGRITY = "sha512-V6K3C8EBdEsPFZXSKMJe6ppQOENxuHARr9GvHX4hh47lAbhMRD9qf4oEK7LoaRQxULMa80/qt5gHO73aCleBBg=="
MERMAID_MEMBER = "package/dist/mermaid.min.js"
SITE_PATH = "javascripts/vendor/mermaid.min.js"

_ROOT = Path(__file__).resolve().parent.parent
# The bundle's script tag in Material's base.html: mermaid must be defined before it runs.
_BUNDLE = re.compile(r'<script src="[^"]*assets/javascripts/bundle\.[0-9a-f]+\.min\.js"></script>')
_HAS_DIAGRAM = re.compile(r'<(?:pre|div) class="mermaid"')

_script: Path | None = None


def _cache_dir() -> Path:
    return Path(os.environ.get("AIOEP_DOCS_CACHE") or _ROOT / ".cache" / "docs")


def _integrity(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def _tarball() -> bytes:
    """The pinned package's tarball, verified; downloaded into the cache on first use."""
    given = os.environ.get("AIOEP_MERMAID_TARBALL")
    path = Path(given) if given else _cache_dir() / f"mermaid-{MERMAID_VERSION}.tgz"
    if path.is_file():
        data = path.read_bytes()
        source = str(path)
    elif given:
        raise PluginError(f"mermaid: AIOEP_MERMAID_TARBALL={given} is not a file")
    else:
        try:
            with urllib.request.urlopen(MERMAID_TARBALL, timeout=60) as response:
                data = response.read()
        except OSError as exc:
            raise PluginError(
                f"mermaid: cannot download {MERMAID_TARBALL} ({exc}); offline, put that file "
                f"at {path} or set AIOEP_MERMAID_TARBALL to its path"
            ) from exc
        source = MERMAID_TARBALL
    got = _integrity(data)
    if got != MERMAID_INTEGRITY:
        raise PluginError(
            f"mermaid: {source} does not match the pinned integrity hash "
            f"(expected {MERMAID_INTEGRITY}, got {got}); not using it"
            + ("" if given or source == MERMAID_TARBALL else " (delete it to download again)")
        )
    if source == MERMAID_TARBALL:
        _write_atomically(path, data)
    return data


def _extract(data: bytes, dest: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        member = tar.extractfile(MERMAID_MEMBER)
        if member is None:
            raise PluginError(f"mermaid: {MERMAID_MEMBER} is not in the package")
        script = member.read()
    _write_atomically(dest, script)


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (a concurrent build never reads half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp:
        tmp.write(data)
    os.replace(tmp.name, path)


def on_config(config: MkDocsConfig, **kwargs: Any) -> MkDocsConfig:
    """Get the verified script into the cache (once per build, a hash of the tarball)."""
    global _script
    dest = _cache_dir() / f"mermaid-{MERMAID_VERSION}.min.js"
    # The extracted copy is trusted only next to the tarball it came from, checked each build.
    _extract(_tarball(), dest)
    _script = dest
    return config


def on_files(files: Files, config: MkDocsConfig, **kwargs: Any) -> Files:
    """Add the script to the site."""
    assert _script is not None
    files.append(File.generated(config, SITE_PATH, abs_src_path=str(_script)))
    return files


def on_post_page(output: str, page: Page, config: MkDocsConfig, **kwargs: Any) -> str:
    """On a page with a diagram, load the script just before Material's bundle."""
    if not _HAS_DIAGRAM.search(output):
        return output
    match = _BUNDLE.search(output)
    if match is None:
        raise PluginError(
            f"mermaid: no Material bundle script tag in {page.file.src_uri}; "
            "cannot load the diagram script before it"
        )
    tag = f'<script src="{get_relative_url(SITE_PATH, page.url)}"></script>\n'
    return output[: match.start()] + tag + output[match.start() :]
