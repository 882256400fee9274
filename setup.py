"""Packages live in folders named by DESIGN.md (plugins/, runtime/) but import as k3plugins / k3runtime."""
from setuptools import find_packages, setup

ROOTS = {"k3build": "k3build", "k3plugins": "plugins", "k3runtime": "runtime"}
packages = []
for name, folder in ROOTS.items():
    packages += [name + p[len(folder):] for p in find_packages(include=[folder, folder + ".*"])]

setup(packages=packages, package_dir={name: folder for name, folder in ROOTS.items()})
