# Kept for tools that still call `python setup.py`; all metadata lives in pyproject.toml.
from setuptools import setup

setup()
