"""Sphinx configuration: the pages are Markdown (MyST), the API reference comes from the
docstrings of the installed package. `make docs` builds them into docs/_build/html with
warnings as errors; tests/unit/test_docs.py builds them the same way."""

project = "pycollectives"
author = "the pycollectives authors"
copyright = "the pycollectives authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the docstrings' Args: sections
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]

# Links to a page's sections by their titles (`page.md#a-section`).
myst_heading_anchors = 4

html_theme = "alabaster"
html_title = "pycollectives"

autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
