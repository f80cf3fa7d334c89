"""The one packaging fact pyproject.toml cannot state: the top-level data/ is the package sp_lab.data.

Everything else (metadata, the data/ -> sp_lab/data mapping, which files ship) is in pyproject.toml; setuptools'
package discovery only finds folders inside sp_lab/, so sp_lab.data is added to what it finds.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["sp_lab*"]), "sp_lab.data"])
