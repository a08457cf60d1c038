from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("bcp-checkpoint")  # the distribution's name on PyPI; the import name is bcp
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"
