"""nxdtp's version, in a module that imports nothing: setup.cfg reads it without importing nxdtp, and checkpoint
writers record it without importing the package above them."""

__version__ = "0.1.0"
