"""Pallas kernels for jaxpool (see docs/pallas.md); ``ops`` is the entry point."""
