"""Build entry: the metadata is in setup.cfg. This file maps the repository's configs/ into the
package as braixdet/configs (braixdet/model_zoo.py finds them there once installed), which
setup.cfg cannot: its ``find:`` lists only packages under projects/BRAIxDet."""
from setuptools import find_packages, setup

SRC = "projects/BRAIxDet"

setup(
    package_dir={"": SRC, "braixdet.configs": "configs"},
    packages=[*find_packages(SRC), "braixdet.configs"],
    # configs/<name>.yaml, configs/<group>/<name>.yaml, configs/demo/<group>/<name>.yaml
    package_data={"braixdet.configs": ["*.yaml", "*/*.yaml", "*/*/*.yaml"]},
)
