"""The Pallas TPU (Mosaic) kernels and their calls (``ops``)."""
