"""Open the built guide in headless Chromium as a reader would, page by page through its navigation.

    python docs/_tools/browse.py SITE_DIR OUT_DIR

Serves SITE_DIR over HTTP on a loopback port, renders the home page in Chromium, follows
every link of the navigation, and checks that each page renders its title (an ``<h1>``) and
that every image it shows is served. Screenshots of the home page and the performance page
go to OUT_DIR. Exit 1 naming every page or image that failed. Needs Debian's ``chromium``.
"""

from __future__ import annotations

import functools
import http.server
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urljoin

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,1600"]
#: Seconds Chromium may take for one page (a cold start on a loaded 2-core machine takes ~3 s).
PAGE_TIMEOUT_S = 60


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit("no Chromium found: install Debian's package with 'apt-get install -y chromium'")


def render(browser: str, url: str) -> str:
    """The DOM of ``url`` after Chromium ran its scripts."""
    proc = subprocess.run([browser, *CHROMIUM_ARGS, "--dump-dom", url], capture_output=True, text=True,
                          timeout=PAGE_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{url}: chromium exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout


def screenshot(browser: str, url: str, path: Path) -> None:
    subprocess.run([browser, *CHROMIUM_ARGS, f"--screenshot={path}", url], capture_output=True, check=True,
                   timeout=PAGE_TIMEOUT_S)
    if not path.is_file() or path.stat().st_size == 0:
        raise RuntimeError(f"{url}: no screenshot written to {path}")


def nav_links(dom: str, base: str) -> list[str]:
    """Every page the navigation links to, in order, once each (anchors and other sites left out)."""
    hrefs = re.findall(r'<a[^>]*class="[^"]*md-nav__link[^"]*"[^>]*href="([^"#]*)"', dom)
    hrefs += re.findall(r'<a[^>]*href="([^"#]*)"[^>]*class="[^"]*md-nav__link[^"]*"', dom)
    pages = [urljoin(base, h) for h in hrefs if h and "://" not in h]
    return list(dict.fromkeys([base, *pages]))


def check_page(browser: str, url: str) -> list[str]:
    dom = render(browser, url)
    problems = []
    if not re.search(r"<h1[ >]", dom):
        problems.append(f"{url}: no <h1> rendered")
    if "404 - Not found" in dom:
        problems.append(f"{url}: the site's 404 page")
    for src in re.findall(r'<img[^>]*src="([^"]+)"', dom):
        img = urljoin(url, src)
        if not img.startswith(url.split("/", 3)[0] + "//" + url.split("/", 3)[2] + "/"):
            problems.append(f"{url}: image {src} is not served by the site (the guide ships its images)")
            continue
        try:
            with urllib.request.urlopen(img, timeout=10) as resp:
                if resp.status != 200 or not resp.read(8):
                    problems.append(f"{url}: image {src} answered {resp.status}")
        except urllib.error.URLError as exc:
            problems.append(f"{url}: image {src}: {exc}")
    return problems


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002  # no line per request
        pass


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    site, out = Path(argv[0]), Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    browser = chromium()
    server, base = serve(site)
    try:
        pages = nav_links(render(browser, base), base)
        problems = [p for page in pages for p in check_page(browser, page)]
        screenshot(browser, base, out / "home.png")
        screenshot(browser, urljoin(base, "performance/"), out / "performance.png")
    finally:
        server.shutdown()
    for line in problems:
        print(line)
    print(f"browse: {len(pages)} pages followed from the navigation, {len(problems)} problem(s); "
          f"screenshots in {out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
