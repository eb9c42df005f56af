"""The package version (one place: the face re-exports it, the GPU tuner keys its cache by it)."""

__version__ = "0.1.0"
