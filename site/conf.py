"""The course as a website: ``make site`` builds ``results/site/`` from README.md, docs/*.md and the tutorial
notebooks with the outputs stored in them (never re-executed).

Why Sphinx + MyST-NB + the Sphinx Book Theme: that is Jupyter Book 1 taken apart, the field's standard
for a course made of notebooks — it renders a notebook's stored outputs (tables, plots, Markdown) as
they are, Markdown pages and LaTeX equations alike, and builds offline from PyPI packages alone.
Jupyter Book 2 (MyST-MD) was not chosen: it needs Node.js and downloads its theme when it builds,
which a machine that reaches only the package registries cannot do. The equations are typeset by
Debian's MathJax (``libjs-mathjax``), copied into the site, so that a page needs nothing from the
network; without it the pages fall back to MathJax's public CDN (and say so when built).

The sources stay where they are (this folder holds only this configuration): the source directory is
the repository's root, ``include_patterns`` picks the pages, and the navigation is README, then the
notebooks in course order (their number), then docs/ — a hidden table of contents added to README as
Sphinx reads it, so the page stays plain Markdown on GitHub. A file of the repository that a page
links to (a module, a results file) is copied into the site at its own path (``copy_linked_files``),
so a link works in the site as it does in the repository.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parent.parent
MATHJAX = Path("/usr/share/javascript/mathjax")

project = "CNN from scratch: numpy loops → fused Numba CUDA kernels → MPI"
author = "the course's authors"
root_doc = "README"
extensions = ["myst_nb"]
include_patterns = ["README.md", "docs/*.md", "notebooks/README.md", "notebooks/[0-9][0-9]_*.ipynb"]
exclude_patterns = ["results/**", ".venv/**", "**/.ipynb_checkpoints"]

nb_execution_mode = "off"                       # the stored outputs of a full run, as committed
nb_output_stderr = "show"
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3                        # README's #anchors work in the site as on GitHub
suppress_warnings = ["myst.header", "mystnb.unknown_mime_type", "misc.highlighting_failure"]

html_theme = "sphinx_book_theme"
html_title = "CNN from scratch"
html_theme_options = {"show_toc_level": 2, "home_page_in_toc": True, "use_download_button": False,
                      "use_fullscreen_button": False}
html_context = {"default_mode": "auto"}        # the theme's light/dark switch starts from the reader's setting
html_favicon = "favicon.svg"                    # a browser asks for one: without it, a 404 on every first page
html_static_path: list[str] = []
html_show_sourcelink = False

if MATHJAX.joinpath("MathJax.js").exists():
    html_static_path.append(str(MATHJAX.parent))
    mathjax_path = "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML"
    mathjax2_config = {"tex2jax": {"inlineMath": [["\\(", "\\)"]], "displayMath": [["\\[", "\\]"]],
                                   "processEscapes": True, "processClass": "math|output_area",
                                   "ignoreClass": "document"}}
else:
    print(f"site: {MATHJAX} not found (apt-get install libjs-mathjax): equations will load MathJax from its CDN")


def course_order() -> list[str]:
    """The pages after README: the notebooks' guide, the tutorial notebooks by number, then docs/ (benchmarks
    first)."""
    notebooks = ["notebooks/README"] + sorted(path.relative_to(ROOT).with_suffix("").as_posix()
                       for path in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    docs = sorted((path.relative_to(ROOT).with_suffix("").as_posix() for path in (ROOT / "docs").glob("*.md")),
                  key=lambda name: (name != "docs/benchmarks", name))
    return notebooks + docs


def add_navigation(app, docname, source) -> None:
    """README as Sphinx reads it (not as the file is): with a hidden table of contents in course order."""
    if docname == root_doc:
        entries = "\n".join(course_order())
        source[0] += f"\n\n```{{toctree}}\n:hidden:\n:maxdepth: 1\n\n{entries}\n```\n"


def copy_linked_files(app, exception) -> None:
    """Copy into the site every repository file a page links to by a relative path that the site lacks,
    at the same path; make README's page the site's index.html."""
    if exception is not None or app.builder.name != "html":
        return
    out = Path(app.outdir)
    for page in out.rglob("*.html"):
        for target in re.findall(r'href="([^"#?]+)', page.read_text(encoding="utf-8")):
            if urlsplit(target).scheme or target.startswith("/"):
                continue
            built, source = (page.parent / unquote(target)).resolve(), None
            try:
                source = ROOT / built.relative_to(out.resolve())
            except ValueError:
                continue
            if not built.exists() and source.is_file() and ".venv" not in source.parts:
                built.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, built)
    shutil.copyfile(out / f"{root_doc}.html", out / "index.html")


def setup(app):
    app.connect("source-read", add_navigation)
    app.connect("build-finished", copy_linked_files)
