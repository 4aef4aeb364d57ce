"""Open every page of the built docs site in headless Chromium, offline, and fail on what a
reader would see broken: a diagram left as raw text, a code sample wider than the content
column (the reader would have to scroll sideways), or a raw reStructuredText role.

A docstring role such as ``:class:`Buffer` `` is printed verbatim by mkdocstrings (Google
style, Markdown): `raw_roles` finds one in the built HTML, without a browser, and the
message says what to write instead (a cross-reference ``[`Buffer`][aioep.Buffer]`` or plain
backticks).

    python .ci/docs_check.py [SITE_DIR]      # default: site

The site is served from 127.0.0.1 by a small stdlib HTTP server that adds a probe script at
the top of each HTML page (for this check only; the built files are not changed). Chromium
may reach only that server: every other host fails to resolve and no proxy is used, like a
machine without network access. The probe waits for the diagrams, measures the code blocks
at a desktop window size, and writes its findings into the DOM as JSON; Chromium's
``--dump-dom`` hands the DOM back and `judge` turns it into a list of problems.

Without Chromium the browser part fails under CI (``CI=true``) and is skipped otherwise, with a
message; the raw-role check runs either way. ``CHROMIUM`` names the binary to use.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WINDOW = (1280, 900)  # a desktop window: Material shows both sidebars from 1220 px
RESULT_ID = "aioep-docs-check"
# Virtual time: Chromium skips idle waits, so this costs far less than 20 s of wall time.
VIRTUAL_TIME_BUDGET_MS = 20_000
PAGE_TIMEOUT_S = 90.0

# The probe runs first on every page. Material replaces each ``pre.mermaid`` with a
# ``div.mermaid`` and puts the diagram's SVG in a *closed* shadow root, which the page
# cannot query: the probe keeps a reference to every shadow root as it is attached.
PROBE = r"""
<script>
(function () {
  "use strict";
  var shadows = [], errors = [], loaded = false, started = Date.now();
  var attach = Element.prototype.attachShadow;
  Element.prototype.attachShadow = function (init) {
    var root = attach.call(this, init);
    shadows.push([this, root]);
    return root;
  };
  window.addEventListener("error", function (e) { errors.push(String(e.message)); });
  window.addEventListener("unhandledrejection", function (e) {
    errors.push("unhandled rejection: " + String(e.reason && (e.reason.message || e.reason)));
  });
  window.addEventListener("load", function () { loaded = true; });
  // Before Material's own DOMContentLoaded handler, which takes the "mermaid" class off each
  // diagram's code block until the script has loaded: mark the code blocks now.
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("pre.mermaid").forEach(function (pre) {
      pre.setAttribute("data-aioep-diagram", "");
    });
  });

  function shadowOf(el) {
    for (var i = 0; i < shadows.length; i++) if (shadows[i][0] === el) return shadows[i][1];
    return null;
  }
  function diagrams() {
    var out = [];
    // In page order: the diagrams Material rendered, and the code blocks it left as text.
    document.querySelectorAll("div.mermaid, pre.mermaid, pre[data-aioep-diagram]")
        .forEach(function (el) {
      var root = shadowOf(el), svg = root && root.querySelector("svg");
      var box = svg ? svg.getBoundingClientRect() : null;
      out.push({
        tag: el.tagName.toLowerCase(),
        svg: !!svg,
        width: box ? Math.round(box.width) : 0,
        height: box ? Math.round(box.height) : 0,
        error: !!(svg && /Syntax error|Parse error/i.test(svg.textContent || "")),
        text: svg ? "" : (el.textContent || "").trim().slice(0, 80)
      });
    });
    return out;
  }
  function codeBlocks() {
    var out = [];
    document.querySelectorAll("pre > code").forEach(function (code) {
      var pre = code.parentElement;
      if (pre.classList.contains("mermaid") || pre.hasAttribute("data-aioep-diagram")) return;
      var over = Math.max(code.scrollWidth - code.clientWidth, pre.scrollWidth - pre.clientWidth);
      var lines = (code.textContent || "").split("\n"), longest = "";
      lines.forEach(function (l) { if (l.length > longest.length) longest = l; });
      out.push({
        visible: pre.clientWidth > 0,
        overflow: over,
        width: code.clientWidth || pre.clientWidth,
        longest: longest.slice(0, 120),
        chars: longest.length
      });
    });
    return out;
  }
  function report(final) {
    var data = {final: final, diagrams: diagrams(), code: codeBlocks(), errors: errors};
    var el = document.getElementById("__RESULT_ID__");
    if (!el) {
      el = document.createElement("script");
      el.type = "application/json";
      el.id = "__RESULT_ID__";
      document.documentElement.appendChild(el);
    }
    el.textContent = JSON.stringify(data).replace(/</g, "\\u003c");
  }
  function tick() {
    var pending = document.querySelectorAll("pre[data-aioep-diagram]").length > 0 ||
      diagrams().some(function (d) { return !d.svg; });
    var settled = loaded && (!pending || Date.now() - started > 15000);
    report(settled);
    if (!settled) setTimeout(tick, 100);
  }
  setTimeout(tick, 100);
})();
</script>
""".replace("__RESULT_ID__", RESULT_ID)


# A Sphinx cross-reference role left in the text: in the HTML Markdown made of a docstring
# the backquoted target became <code>...</code>; elsewhere (a code sample) it is still there.
_ROLE = re.compile(
    r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const|type):"
    r"(?:`([^`<\n]{0,200})`?|<code>([^<]{0,200})</code>)"
)


def raw_roles(page: str, page_html: str) -> list[str]:
    """A problem for each raw reStructuredText role (``:class:`X` ``...) in the built page."""
    problems: list[str] = []
    for m in _ROLE.finditer(page_html):
        target = m.group(1) if m.group(1) is not None else m.group(2)
        role = m.group(0).split(":`")[0].split(":<code>")[0] + ":"
        line = page_html.count("\n", 0, m.start()) + 1
        problems.append(
            f"{page}:{line}: raw reStructuredText role {role}`{target}`, shown verbatim: write a "
            f"cross-reference [`{target.lstrip('~')}`][aioep.Name] or plain backticks"
        )
    return problems


@dataclass
class PageResult:
    page: str
    problems: list[str]
    seconds: float


def expected_diagrams(page_html: str) -> int:
    """How many diagrams the built page holds (superfences writes ``<pre class="mermaid">``)."""
    return len(re.findall(r'<pre class="mermaid"', page_html))


def judge(page: str, expected: int, dom: str) -> list[str]:
    """The problems a reader would see on ``page``, from Chromium's dumped ``dom``.

    ``expected``: the number of diagrams in the built HTML. Every one must have become an
    SVG (not left as text, not mermaid's error picture), and no visible code block may be
    wider than its column.
    """
    match = re.search(
        rf'<script type="application/json" id="{RESULT_ID}">(.*?)</script>', dom, re.DOTALL
    )
    if match is None:
        return [f"{page}: the probe left no findings (the page did not load or its script failed)"]
    try:
        data: dict[str, Any] = json.loads(match.group(1))
    except ValueError as exc:
        return [f"{page}: the probe's findings are not JSON ({exc})"]
    problems: list[str] = []
    diagrams: list[dict[str, Any]] = data.get("diagrams", [])
    rendered = 0
    for i, d in enumerate(diagrams, 1):
        if not d.get("svg"):
            problems.append(
                f"{page}: diagram {i} is not rendered; the reader sees its source: "
                f"{d.get('text', '')!r}"
            )
        elif d.get("error"):
            problems.append(f"{page}: diagram {i} rendered as mermaid's syntax-error picture")
        elif not (d.get("width", 0) > 0 and d.get("height", 0) > 0):
            problems.append(f"{page}: diagram {i} rendered as an empty SVG")
        else:
            rendered += 1
    raw_left = re.search(r'<pre class="mermaid"|<pre [^>]*data-aioep-diagram', dom)
    if len(diagrams) < expected or rendered < len(diagrams) or raw_left:
        problems.append(
            f"{page}: {expected} diagram(s) in the page, {rendered} rendered"
            + ("" if data.get("final") else " (the page had not settled)")
        )
    if expected and rendered < expected and data.get("errors"):
        errors = list(dict.fromkeys(str(e).strip().split("\n")[0][:200] for e in data["errors"]))
        problems.append(f"{page}: script errors: {'; '.join(errors[:3])}")
    for i, c in enumerate(data.get("code", []), 1):
        if c.get("visible") and c.get("overflow", 0) > 0:
            problems.append(
                f"{page}: code block {i} is {c['overflow']} px wider than the column "
                f"({c['width']} px); its longest line ({c['chars']} chars) is "
                f"{c['longest']!r}: rewrap it"
            )
    return problems


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the site; HTML pages get the probe as the first thing in ``<head>``."""

    def send_head(self) -> Any:
        path = Path(self.translate_path(self.path))
        if path.is_dir():
            path = path / "index.html"
        if path.suffix != ".html" or not path.is_file():
            return super().send_head()
        body = path.read_bytes()
        body = body.replace(b"<head>", b"<head>" + PROBE.encode(), 1)
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        return io.BytesIO(body)  # copyfile reads it, do_GET closes it

    def log_message(self, format: str, *args: Any) -> None:
        pass


def find_chromium() -> str | None:
    named = os.environ.get("CHROMIUM")
    if named:
        return shutil.which(named) or (named if os.access(named, os.X_OK) else None)
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def chromium_args(chromium: str, profile: str, url: str) -> list[str]:
    return [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        # Offline: only the local server resolves, and nothing goes through a proxy.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--no-proxy-server",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--no-default-browser-check",
        "--hide-scrollbars",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        f"--virtual-time-budget={VIRTUAL_TIME_BUDGET_MS}",
        "--dump-dom",
        url,
    ]


def check_page(chromium: str, base: str, site: Path, page: Path) -> PageResult:
    rel = page.relative_to(site).as_posix()
    t0 = time.monotonic()
    expected = expected_diagrams(page.read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory(prefix="aioep-docs-check-") as profile:
        try:
            proc = subprocess.run(
                chromium_args(chromium, profile, f"{base}/{rel}"),
                capture_output=True,
                text=True,
                timeout=PAGE_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return PageResult(rel, [f"{rel}: Chromium took over {PAGE_TIMEOUT_S:.0f} s"], 0.0)
    if proc.returncode != 0 and not proc.stdout:
        tail = proc.stderr.strip().splitlines()[-3:]
        return PageResult(
            rel, [f"{rel}: Chromium exited {proc.returncode}: {' | '.join(tail)}"], 0.0
        )
    return PageResult(rel, judge(rel, expected, proc.stdout), time.monotonic() - t0)


def pages_of(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if p.is_file())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", nargs="?", default="site", type=Path)
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    site: Path = args.site.resolve()
    pages = pages_of(site)
    if not pages:
        print(f"docs check: no HTML pages under {site}; build the site first", file=sys.stderr)
        return 1
    role_problems = [
        p
        for page in pages
        for p in raw_roles(page.relative_to(site).as_posix(), page.read_text(encoding="utf-8"))
    ]
    chromium = find_chromium()
    if chromium is None:
        msg = "docs check: no Chromium (as root on Debian: bash .ci/install-chromium.sh; or set CHROMIUM)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            print(f"{msg}: failing, CI must run the browser check", file=sys.stderr)
            return 1
        print(f"{msg}: SKIPPED the browser check of the built pages", file=sys.stderr)
        return _report(role_problems, f"docs check: no raw role in {len(pages)} pages")

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Handler, directory=str(site))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            results = list(pool.map(lambda p: check_page(chromium, base, site, p), pages))
    finally:
        server.shutdown()
        server.server_close()
    problems = role_problems + [p for r in results for p in r.problems]
    slowest = max(results, key=lambda r: r.seconds)
    print(
        f"docs check: {len(pages)} pages in headless Chromium, offline, "
        f"{WINDOW[0]}x{WINDOW[1]}: {time.monotonic() - t0:.1f} s "
        f"(slowest {slowest.page}, {slowest.seconds:.1f} s)",
        flush=True,
    )
    return _report(
        problems,
        "docs check: every diagram rendered, no code block wider than its column, no raw role",
    )


def _report(problems: list[str], ok: str) -> int:
    if problems:
        print(f"docs check: FAILED, {len(problems)} problem(s):", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    print(ok)
    return 0


if __name__ == "__main__":
    sys.exit(main())
