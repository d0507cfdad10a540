"""Sphinx configuration: the guide pages include README.rst's sections; the API is autodoc."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "multienv"
author = "the multienv authors"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_mock_imports = ["ray", "stable_baselines3"]  # optional extras
exclude_patterns = ["_build"]
html_theme = "alabaster"
nitpicky = False
