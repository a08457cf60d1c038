"""The version of bcp, in one place: pyproject.toml reads it from here (``[tool.setuptools.dynamic]``),
so an installed distribution, a stale editable install and a source tree all agree with the manifests
this tree writes (``bcp_version``)."""

__version__ = "0.2.0"
