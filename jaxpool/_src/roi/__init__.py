"""ROI pooling for detection: ``roi_align``, ``roi_pool``, ``multi_scale_roi_align``.

One folder per op family: ``api.py`` (the public functions and their checks), ``plan.py`` (the
static configuration and the sampling plans computed from the boxes), ``form.py`` (the sampled
sum and its derivatives as jaxpool primitives), ``xla.py`` (the XLA path), ``triton.py`` (the
GPU kernels of the average's forward and feature gradient) and ``kernels.py`` (the primitive
that runs them, as the Pallas Triton backend calls it).
"""
