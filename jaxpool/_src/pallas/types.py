"""The kernels' modes and ops as ``Literal`` types, named once for every room of the package.

Each is also a tuple of its values (``typing.get_args``), for the checks that name them.
"""

from __future__ import annotations

from typing import Literal, get_args

# What a pooling kernel reduces: the maximum or the average (a backward kernel's mode: the
# gradient of which).
PoolKind = Literal["max", "avg"]

# A forward kernel's mode: the maximum, the maximum and each window's winning tap, or the
# average.
ForwardMode = Literal["max", "argmax", "avg"]

# A kernel of the Triton launch space, as the tuner keys it and ``jaxpool.tune --ops`` names
# it: a forward mode or a pool kind, and its direction.
KernelOp = Literal["max_fwd", "argmax_fwd", "avg_fwd", "max_bwd", "avg_bwd"]
KERNEL_OPS: tuple[KernelOp, ...] = get_args(KernelOp)

# The form of the Triton max kernels' running maximum (``triton/max.nan_max``): "ptx" (PTX's
# ``max.NaN.f32``), "beats" (``dtypes.beats``) or "canonical" ("beats" with PTX's NaN results).
MaxForm = Literal["ptx", "beats", "canonical"]
MAX_FORMS: tuple[MaxForm, ...] = get_args(MaxForm)
