"""In-tree PEP 517 backend: setuptools, plus the installed torch made visible to an isolated build.

pip builds in an isolated environment that hides the target environment's site-packages. sbd_ext must compile
against exactly the torch the user runs (a C++ extension is tied to one torch ABI), and listing torch as a build
requirement would make pip fetch the newest torch, a multi-GB CUDA build, on any machine. So the hooks below
append the target environment's site-packages (found from the interpreter pip runs, whose sys.prefix is that
environment) to sys.path before setup.py runs; everything else comes from the isolated environment.
"""

import sys
import sysconfig

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (the remaining PEP 517 hooks)


def _expose_installed_torch() -> None:
    try:
        import torch  # noqa: F401

        return
    except ImportError:
        pass
    paths = sysconfig.get_paths(vars={"base": sys.prefix, "platbase": sys.prefix})
    for key in ("purelib", "platlib"):
        if paths[key] not in sys.path:
            sys.path.append(paths[key])


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _expose_installed_torch()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _expose_installed_torch()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)


def get_requires_for_build_wheel(config_settings=None):
    _expose_installed_torch()
    return _setuptools.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_editable(config_settings=None):
    _expose_installed_torch()
    return _setuptools.get_requires_for_build_editable(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _expose_installed_torch()
    return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    _expose_installed_torch()
    return _setuptools.prepare_metadata_for_build_editable(metadata_directory, config_settings)
