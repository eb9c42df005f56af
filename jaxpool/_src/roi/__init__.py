"""ROI pooling for detection: ``roi_align``, ``roi_pool``, ``multi_scale_roi_align``.

One folder per op family: ``api.py`` (the public functions and their checks), ``plan.py`` (the
static configuration and the sampling plans computed from the boxes), ``form.py`` (the sampled
sum and its derivatives as jaxpool primitives), ``xla.py`` (the XLA path).
"""
