"""jaxpool: pooling for JAX with exact, deterministic gradients and Pallas kernels."""

from jaxpool._src.adaptive import adaptive_avg_pool as adaptive_avg_pool
from jaxpool._src.adaptive import adaptive_max_pool as adaptive_max_pool
from jaxpool._src.adaptive import adaptive_max_pool_with_indices as adaptive_max_pool_with_indices
from jaxpool._src.adaptive import global_avg_pool as global_avg_pool
from jaxpool._src.adaptive import global_max_pool as global_max_pool
from jaxpool._src.api import avg_pool as avg_pool
from jaxpool._src.api import avg_pool_grad as avg_pool_grad
from jaxpool._src.api import l2_pool as l2_pool
from jaxpool._src.api import lp_pool as lp_pool
from jaxpool._src.api import lp_pool_grad as lp_pool_grad
from jaxpool._src.api import max_pool as max_pool
from jaxpool._src.api import max_pool_grad as max_pool_grad
from jaxpool._src.api import max_pool_grad_from_taps as max_pool_grad_from_taps
from jaxpool._src.api import max_pool_with_indices as max_pool_with_indices
from jaxpool._src.api import max_pool_with_taps as max_pool_with_taps
from jaxpool._src.api import max_unpool as max_unpool
from jaxpool._src.api import min_pool as min_pool
from jaxpool._src.optimize import optimize as optimize
from jaxpool._src.platforms import PallasInterpreterWarning as PallasInterpreterWarning
from jaxpool._src.roi.api import roi_align as roi_align
from jaxpool._src.roi.api import roi_pool as roi_pool
from jaxpool._src.roi.multi_scale import multi_scale_roi_align as multi_scale_roi_align
from jaxpool._src.windows import Geometry as Geometry
from jaxpool._src.windows import make_geometry as make_geometry

from jaxpool._src.version import __version__ as __version__

__all__ = [
    "adaptive_avg_pool", "adaptive_max_pool", "adaptive_max_pool_with_indices", "avg_pool",
    "avg_pool_grad", "Geometry", "global_avg_pool", "global_max_pool", "l2_pool", "lp_pool",
    "lp_pool_grad", "make_geometry", "max_pool", "max_pool_grad",
    "max_pool_grad_from_taps", "max_pool_with_indices", "max_pool_with_taps", "max_unpool",
    "min_pool", "multi_scale_roi_align", "optimize", "PallasInterpreterWarning", "roi_align",
    "roi_pool",
]
