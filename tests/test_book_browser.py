"""The rendered book: it builds with every warning an error, and every page works in a real browser.

The first test builds the book strictly (`jupyter-book build . -W -n --keep-going`,
plus `--all` so that every page is read again and its warnings are seen again). Notebooks come from
the execution cache in `_build/.jupyter_cache` when their code has not changed, so after a first
build (or `make book`) this takes seconds; from a fresh clone it executes every notebook once.

The browser tests serve `_build/html` on 127.0.0.1 and open every page in Debian's headless
Chromium through its ChromeDriver (no browser download: `scripts/setup.sh` installs the Debian
packages when it runs as root). Screenshots and a JSON report land in `_build/screenshots/`.
Formulas must be typeset by MathJax served from the book itself (`_ext/local_mathjax.py`): the
browser here has no network, and neither has a reader who opens `_build/html` offline.

At 1400 px, with every folded cell opened, no code block scrolls sideways, no output shows a warning,
a traceback, a progress bar or a path of the machine that built the book, and every table cell is
padded (`_static/book.css`). Launch buttons appear on the notebook pages only and open this
repository (`_config.yml` `repository.url`), whose `binder/` folder installs fa_lab.
"""
from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
SHOTS = ROOT / "_build" / "screenshots"
BOOK_TITLE = "FlashAttention Lab"

# a fresh clone executes every notebook here: allow far more than pytest's per-test default
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--hide-scrollbars",
]
WINDOW = (1280, 1000)
WIDE = (1400, 1000)   # the reading checks: a laptop's browser, sidebars open
#: what a reader must never see in a cell's output: a warning, a traceback, a progress bar frozen
#: mid-run, or a folder of the machine that built the book
NOISE = re.compile(r"\w*Warning\b|Traceback|IProgress|\d+%\|[█▏▎▍▌▋▊▉ ]*\||it/s\]|/site-packages/|/dist-packages/"
                   r"|/work/|/home/|/root/|/tmp/|/Users/|\b[A-Z]:\\[A-Za-z]")
MAX_SHOT_HEIGHT = 6000  # px: long chapters are cut there, which is enough to see the layout
STRAY_MARKDOWN = Path(".venv/lib/python3/site-packages/some_package/README.md")


# --------------------------------------------------------------------------- building


@pytest.fixture(scope="module")
def book_build():
    """Build the book once for this module; the result is asserted by test_book_builds_clean."""
    pytest.importorskip("jupyter_book", reason="jupyter-book is not installed (scripts/setup.sh installs it)")
    # jupyter-book 1.x has no `python -m jupyter_book`: call its console entry point with this Python
    cmd = [sys.executable, "-c", "from jupyter_book.cli.main import main; main()",
           "build", str(ROOT), "--all", "-W", "-n", "--keep-going"]
    # the notebooks' kernels import fa_lab from this checkout, whatever else is installed
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # a virtual environment inside the clone (as the README suggests) holds Markdown files of its
    # own; the build must ignore them, so build with one present
    stray = ROOT / STRAY_MARKDOWN
    created = not stray.exists()
    if created:
        stray.parent.mkdir(parents=True, exist_ok=True)
        stray.write_text("# Not part of the book\n\nA package's README inside a virtual environment.\n")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        if created:
            stray.unlink()
            for parent in stray.relative_to(ROOT).parents:  # remove only the folders made here
                if str(parent) != "." and not any((ROOT / parent).iterdir()):
                    (ROOT / parent).rmdir()
    log = proc.stdout + proc.stderr
    (ROOT / "_build").mkdir(exist_ok=True)
    (ROOT / "_build" / "book_build.log").write_text(log)
    return proc.returncode, log


#: libzmq's own assertion, printed by a notebook kernel that aborts while it closes its sockets
#: (e.g. "Assertion failed: pfd.revents & POLLIN (src/signaler.cpp:238)"): a known race inside
#: libzmq, not in the book's code
ZMQ_TEARDOWN = re.compile(r"^Assertion failed: .+ \(src/\w+\.cpp:\d+\)$")


def _problems(log: str) -> list[str]:
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    return [ansi.sub("", line) for line in log.splitlines()
            if re.search(r"\b(WARNING|ERROR|CRITICAL)\b:|Traceback|failed", line)
            and "Kernel is running over TCP" not in line]


def _serious(problems: list[str]) -> list[str]:
    """The problems that fail the build check.

    A kernel that dies while a notebook runs fails that notebook's execution, which myst-nb reports
    as a warning of its own (an error under -W). So when libzmq's teardown assertion is the only
    problem, every notebook ran to its end and the abort came as a kernel shut down: it is reported
    as a warning, not a failure of the book.
    """
    if all(ZMQ_TEARDOWN.match(line.strip()) for line in problems):
        return []
    return problems


def test_serious_problems_keep_everything_but_a_lone_zmq_teardown_abort():
    abort = "Assertion failed: pfd.revents & POLLIN (src/signaler.cpp:238)"
    failed = "WARNING: Executing notebook failed: DeadKernelError"
    assert _serious(_problems(abort)) == []
    assert _serious(_problems(f"{abort}\n{failed}")) == [abort, failed]
    assert _serious(_problems("AssertionError: Assertion failed: x (src/a.cpp:1) in a cell")) != []


def test_book_builds_clean(book_build):
    returncode, log = book_build
    found = _problems(log)
    problems = _serious(found)
    if not problems:   # what was found, if anything, is libzmq's teardown aborts alone
        for line in found:
            warnings.warn(f"a notebook kernel aborted in libzmq as it shut down: {line.strip()}", stacklevel=1)
    assert returncode == 0 and not problems, (
        f"jupyter-book build -W -n failed (exit {returncode}); full log in _build/book_build.log:\n"
        + "\n".join(problems[:40] or log.splitlines()[-40:]))


def _toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]

    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                files.append(node["file"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk({k: v for k, v in toc.items() if k != "root"})
    return [re.sub(r"\.(ipynb|md)$", "", f) for f in files]


def test_virtual_environment_is_not_part_of_the_book(book_build):
    stray_pages = [p for p in HTML.rglob("*.html") if ".venv" in p.parts or "site-packages" in p.parts]
    assert not (HTML / STRAY_MARKDOWN).with_suffix(".html").exists() and not stray_pages, stray_pages[:5]


def test_every_toc_entry_has_a_page(book_build):
    missing_source = [f for f in _toc_files()
                      if not any((ROOT / f).with_suffix(s).exists() for s in (".ipynb", ".md"))]
    missing_html = [f for f in _toc_files() if not (HTML / f).with_suffix(".html").exists()]
    assert not missing_source, f"_toc.yml names files that do not exist: {missing_source}"
    assert not missing_html, f"no page was built for: {missing_html}"


# --------------------------------------------------------------------------- static checks


class _Page(HTMLParser):
    """Every id, every link/resource URL, the <title> and the first <h1> of one HTML page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids, self.urls, self.title, self.h1 = set(), [], "", None
        self._in = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if a.get("name") and tag == "a":
            self.ids.add(a["name"])
        attr = {"a": "href", "link": "href", "img": "src", "script": "src", "iframe": "src"}.get(tag)
        if attr and a.get(attr) is not None:
            self.urls.append((tag, a[attr]))
        if tag == "title" or (tag == "h1" and self.h1 is None):
            self._in = tag
            if tag == "h1":
                self.h1 = ""

    def handle_endtag(self, tag):
        if tag == self._in:
            self._in = None

    def handle_data(self, data):
        if self._in == "title":
            self.title += data
        elif self._in == "h1":
            self.h1 += data


@functools.lru_cache(maxsize=None)
def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def _pages() -> list[str]:
    """Every HTML page of the built book, as paths relative to _build/html."""
    skip = ("_static", "_sources", "_images")
    return sorted(p.relative_to(HTML).as_posix() for p in HTML.rglob("*.html")
                  if p.relative_to(HTML).parts[0] not in skip)


def _is_redirect(rel: str) -> bool:
    return 'http-equiv="Refresh"' in (HTML / rel).read_text(encoding="utf-8")[:2000]


def test_internal_links_resolve(book_build):
    if not (HTML / "intro.html").exists():
        pytest.fail("the book was not built (see test_book_builds_clean)")
    broken = []
    for rel in _pages():
        for tag, url in _parse(HTML / rel).urls:
            parts = urlsplit(url)
            if parts.scheme or url.startswith("//") or not (parts.path or parts.fragment):
                continue  # external (http, mailto, data, javascript) or a bare "#"
            target = (HTML / rel).parent / unquote(parts.path) if parts.path else HTML / rel
            target = target.resolve()
            if target.is_dir():
                target = target / "index.html"
            if HTML.resolve() not in target.parents or not target.exists():
                broken.append(f"{rel}: <{tag}> {url} -> no such file")
            elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in _parse(target).ids:
                broken.append(f"{rel}: <{tag}> {url} -> no id {parts.fragment!r} in {target.name}")
    assert not broken, "broken internal links:\n" + "\n".join(broken)


def test_chapters_link_their_exercises(book_build):
    """book/NN_x links to exercises/NN_y, for every exercises notebook in the table of contents."""
    chapters = {f.split("/")[1][:2]: f for f in _toc_files() if f.startswith("book/")}
    missing = []
    for ex in (f for f in _toc_files() if f.startswith("exercises/")):
        chapter = chapters.get(ex.split("/")[1][:2])
        page = HTML / f"{chapter}.html"
        if chapter is None or not page.exists():
            missing.append(f"{ex}: no chapter page with its number")
            continue
        html = page.read_text(encoding="utf-8")
        article = html[html.find("<article"):html.find("</article>")]  # the page, not the sidebar
        if f'href="../{ex}.html' not in article:
            missing.append(f"{chapter} does not link to {ex}")
    assert not missing, "\n".join(missing)


def _repository() -> tuple[str, str]:
    """(url, "org/repo") from _config.yml: the one place the repository's address is configured."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    url = (config.get("repository") or {}).get("url", "").rstrip("/")
    return url, urlsplit(url).path.strip("/")


def _launch_links(rel: str) -> list[str]:
    html = (HTML / rel).read_text(encoding="utf-8")
    group = re.search(r'<div class="dropdown dropdown-launch-buttons">(.*?)</ul>', html, re.S)
    return re.findall(r'href="([^"]+)"', group.group(1)) if group else []


def test_launch_buttons_only_on_notebooks_and_configured(book_build):
    url, org_repo = _repository()
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url), f"_config.yml repository.url: {url!r}"
    assert not re.search(r"(?i)example|your|placeholder|executablebooks|<|todo", url), url
    binder = ROOT / "binder"
    setup = " ".join(p.read_text() for p in binder.glob("*") if p.is_file()) if binder.is_dir() else ""
    assert "torch" in setup and re.search(r"pip install[^\n]* -e \.|^-e \.", setup, re.M), \
        "binder/ must install a CPU torch and fa_lab from the clone (requirements.txt, postBuild)"
    problems = []
    for name in _toc_files():
        rel = f"{name}.html"
        if not (HTML / rel).exists():
            continue
        links = _launch_links(rel)
        if not (ROOT / name).with_suffix(".ipynb").exists():
            problems += [f"{rel}: a launch button on a page that is no notebook: {link}" for link in links]
            continue
        if not {"mybinder.org", "colab.research.google.com"} <= {urlsplit(link).netloc for link in links}:
            problems.append(f"{rel}: launch buttons {links}, expected Binder and Colab")
        problems += [f"{rel}: launch button not for {org_repo}/{name}.ipynb: {link}" for link in links
                     if f"/{org_repo}/" not in link or not link.endswith(f"{name}.ipynb")]
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- in the browser


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server(book_build):
    if not (HTML / "intro.html").exists():
        pytest.fail("the book was not built (see test_book_builds_clean)")
    handler = functools.partial(_QuietHandler, directory=str(HTML))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


def _find_chromium():
    browser = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        pytest.skip("no Debian chromium/chromium-driver here: `scripts/setup.sh` installs them when run as root "
                    "(apt-get install -y chromium chromium-driver); this test downloads no browser")
    return browser, driver


@pytest.fixture(scope="module")
def browser(server):
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (requirements.txt)")
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = _find_chromium()
    profile = tempfile.mkdtemp(prefix="fa-lab-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={profile}", "--window-size={},{}".format(*WINDOW)]:
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


# Waits for every image (lazy ones made eager), then reports whether each one decoded.
_IMAGES_JS = """
const done = arguments[arguments.length - 1];
const imgs = Array.from(document.images);
Promise.all(imgs.map(img => {
  img.loading = "eager";
  if (img.complete) return Promise.resolve();
  return new Promise(r => { img.addEventListener("load", r); img.addEventListener("error", r); });
})).then(() => done(imgs.map(i => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0}))));
"""


# Formulas on the page, whether MathJax is loaded (and from the book itself, _ext/local_mathjax.py),
# and how many formulas it typeset once its start-up promise settles (a CDN copy cannot load offline).
_MATH_JS = """
const done = arguments[arguments.length - 1];
const script = document.querySelector('script[src*="mathjax"]');
const count = () => done({math: document.querySelectorAll('.math').length, mathjax_script: !!script,
                          local_mathjax: !!script && script.src.startsWith(location.origin),
                          typeset: document.querySelectorAll('mjx-container').length});
const startup = window.MathJax && window.MathJax.startup;
if (startup && startup.promise) startup.promise.then(count, count); else count();
"""


def _screenshot(driver, path: Path):
    """The whole page (cut at MAX_SHOT_HEIGHT): the window grows to the page's height for the shot."""
    driver.execute_script("window.scrollTo(0, 0)")
    height = driver.execute_script(
        "return Math.max(document.body.scrollHeight, document.documentElement.scrollHeight)")
    driver.set_window_size(WINDOW[0], min(max(height, WINDOW[1]), MAX_SHOT_HEIGHT))
    driver.save_screenshot(str(path))
    driver.set_window_size(*WINDOW)


def test_every_page_in_chromium(browser, server):
    SHOTS.mkdir(parents=True, exist_ok=True)
    report, failures = [], []
    for rel in _pages():
        browser.get_log("browser")  # drop what earlier pages left
        browser.get(urljoin(server, rel))
        landed = browser.current_url[len(server):]
        if _is_redirect(rel):
            ok = (HTML / landed).exists() and not _is_redirect(landed)
            report.append({"page": rel, "redirects_to": landed})
            if not ok:
                failures.append(f"{rel}: redirect lands on {landed!r}, not a page of the book")
            continue
        title = browser.title
        page = _parse(HTML / rel)
        images = browser.execute_async_script(_IMAGES_JS)
        local = [i for i in images if i["src"].startswith(server) or i["src"].startswith("data:")]
        external = [i["src"] for i in images if i not in local]
        logs = browser.get_log("browser")
        local_errors = [e["message"] for e in logs if e["level"] == "SEVERE" and server in e["message"]]
        other_errors = [e["message"] for e in logs if e["level"] == "SEVERE" and server not in e["message"]]
        math = browser.execute_async_script(_MATH_JS)
        shot = SHOTS / (rel.replace("/", "__").removesuffix(".html") + ".png")
        _screenshot(browser, shot)
        report.append({"page": rel, "title": title, "images": len(local), "external_images": external,
                       "local_errors": local_errors, "external_errors": other_errors, **math,
                       "screenshot": shot.relative_to(ROOT).as_posix()})

        # the title: "<page heading> — FlashAttention Lab" (Sphinx's search page uses " - ")
        if not re.fullmatch(rf".+ (—|-) {re.escape(BOOK_TITLE)}", title):
            failures.append(f"{rel}: title {title!r} is not '<page> — {BOOK_TITLE}'")
        elif page.h1 is not None and page.h1.strip("#¶ \n") not in title:
            failures.append(f"{rel}: title {title!r} does not name the page's heading {page.h1.strip()!r}")
        failures += [f"{rel}: image did not load: {i['src']}" for i in local if not i["ok"]]
        failures += [f"{rel}: browser error: {m}" for m in local_errors]
        if math["math"] and not math["mathjax_script"]:
            failures.append(f"{rel}: has {math['math']} formulas but loads no MathJax")
        elif math["math"] and not math["local_mathjax"]:
            failures.append(f"{rel}: MathJax comes from a CDN, formulas cannot render offline "
                            "(django-static-mathjax missing? see _ext/local_mathjax.py)")
        elif math["math"] and math["typeset"] < math["math"]:
            failures.append(f"{rel}: MathJax typeset {math['typeset']} of its {math['math']} formulas")

    (SHOTS / "report.json").write_text(json.dumps(report, indent=1))
    assert report, "no pages found in _build/html"
    assert not failures, "\n".join(failures)


# Opens every folded cell, then measures what a reader sees: code blocks wider than their box, the
# text of every cell output, and table cells without padding.
_READING_JS = """
document.querySelectorAll('details').forEach(d => { d.open = true; });
const article = document.querySelector('article') || document.body;
const where = el => (el.closest('.cell') || el).id || el.closest('section')?.id || '';
const wide = Array.from(article.querySelectorAll('pre'))
  .filter(pre => pre.scrollWidth > pre.clientWidth + 1)
  .map(pre => ({where: where(pre), scroll: pre.scrollWidth, client: pre.clientWidth,
                text: pre.innerText.split('\\n')[0].slice(0, 80)}));
const outputs = Array.from(article.querySelectorAll('.cell_output')).map(o => o.innerText);
const unpadded = Array.from(article.querySelectorAll('td, th')).filter(c => {
  const s = getComputedStyle(c);
  return !(parseFloat(s.paddingLeft) > 0 && parseFloat(s.paddingRight) > 0);
}).map(c => c.innerText.slice(0, 40));
return {wide: wide, outputs: outputs, unpadded: unpadded,
        cells: article.querySelectorAll('td, th').length, width: window.innerWidth};
"""


def test_pages_read_cleanly_at_1400px(browser, server):
    browser.set_window_size(*WIDE)
    failures = []
    try:
        for rel in _pages():
            if _is_redirect(rel):
                continue
            browser.get(urljoin(server, rel))
            seen = browser.execute_script(_READING_JS)
            failures += [f"{rel}: a code block scrolls sideways ({w['scroll']} > {w['client']} px) in "
                         f"{w['where'] or 'the page'}: {w['text']!r}" for w in seen["wide"]]
            for text in seen["outputs"]:
                hit = NOISE.search(text)
                if hit:
                    failures.append(f"{rel}: an output shows {hit.group(0)!r}: "
                                    f"{text[max(0, hit.start() - 60):hit.end() + 60]!r}")
            if seen["unpadded"]:
                failures.append(f"{rel}: {len(seen['unpadded'])} of {seen['cells']} table cells have no padding, "
                                f"e.g. {seen['unpadded'][:3]}")
    finally:
        browser.set_window_size(*WINDOW)
    assert not failures, "\n".join(failures)
