"""The package version, in one place (``shiftguard.__version__``; read by the build from here)."""

__version__ = "0.1.0"
