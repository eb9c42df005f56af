"""The Pallas Triton (GPU) kernels, their calls (``ops``) and their launch space (``config``)."""
