"""The public functional API, one module per subject, gathered here.

``api_max.py``: the max-type pools (max, min, with indices or taps, their gradients,
unpooling); ``api_avg.py``: the sum-type pools (average, Lp, their gradients);
``api_args.py``: the argument types and shared checks. Each public function checks its
arguments, asks the backend registry (``dispatch.py``) for the backend that serves the call
and calls its method for the op. The graph, the interop layers and ``optimize`` call the
functions through this module.
"""

from __future__ import annotations

from jaxpool._src.api_args import Activation as Activation
from jaxpool._src.api_args import AvgIn as AvgIn
from jaxpool._src.api_args import AvgOut as AvgOut
from jaxpool._src.api_args import DataFormat as DataFormat
from jaxpool._src.api_args import FloatGrad as FloatGrad
from jaxpool._src.api_args import FloatIn as FloatIn
from jaxpool._src.api_args import FloatOut as FloatOut
from jaxpool._src.api_args import FloatOutIn as FloatOutIn
from jaxpool._src.api_args import Implementation as Implementation
from jaxpool._src.api_args import IndicesIn as IndicesIn
from jaxpool._src.api_args import IndicesOut as IndicesOut
from jaxpool._src.api_args import MaskIn as MaskIn
from jaxpool._src.api_args import Padding as Padding
from jaxpool._src.api_args import PoolIn as PoolIn
from jaxpool._src.api_args import PoolOut as PoolOut
from jaxpool._src.api_args import PooledIn as PooledIn
from jaxpool._src.api_args import TapsIn as TapsIn
from jaxpool._src.api_args import TapsOut as TapsOut
from jaxpool._src.api_args import UnpooledOut as UnpooledOut
from jaxpool._src.api_avg import avg_pool as avg_pool
from jaxpool._src.api_avg import avg_pool_grad as avg_pool_grad
from jaxpool._src.api_avg import lp_pool as lp_pool
from jaxpool._src.api_avg import l2_pool as l2_pool
from jaxpool._src.api_avg import lp_pool_grad as lp_pool_grad
from jaxpool._src.api_max import max_pool as max_pool
from jaxpool._src.api_max import min_pool as min_pool
from jaxpool._src.api_max import max_pool_with_indices as max_pool_with_indices
from jaxpool._src.api_max import max_pool_with_taps as max_pool_with_taps
from jaxpool._src.api_max import max_pool_grad_from_taps as max_pool_grad_from_taps
from jaxpool._src.api_max import max_pool_grad as max_pool_grad
from jaxpool._src.api_max import max_unpool as max_unpool
