"""Packages: modelzoo, and conversion/ installed as modelzoo.conversion, so that a top-level `conversion` package
(PyPI has one) neither shadows it nor is shadowed by it. The rest of the metadata is in pyproject.toml."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["modelzoo", "modelzoo.*"]), "modelzoo.conversion"],
      package_dir={"modelzoo.conversion": "conversion"})
