"""A tuning trial's inputs (``triton.launch_for``): arrays of the kernel's operand shapes, from
a hash of each element's position, computed by one compiled program a shape, dtype and taps."""

from __future__ import annotations

import concurrent.futures
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


@functools.lru_cache(maxsize=32)
def _inputs_program(shape, dtype: str, taps):
  """The compiled program of :func:`trial_inputs` for one shape, dtype and taps (shared by the
  kernels that take them)."""

  def draw(salt):
    position = jnp.arange(math.prod(shape), dtype=jnp.uint32).reshape(shape)

    def bits(salt):
      """Pseudo-random bits of each element's position (a multiplicative hash): elementwise,
      so that it compiles in a fraction of a second and runs at memory speed."""
      h = position ^ salt
      for mul, shift in ((0x7FEB352D, 15), (0x846CA68B, 16)):
        h = (h ^ (h >> 16)) * np.uint32(mul)
        h = h ^ (h >> shift)
      return h

    h = bits(salt)
    if np.dtype(dtype).kind in "biu":  # (integers from -2^14 to 2^14 - 1, wrapped to dtype)
      data = ((h >> 17).astype(jnp.int32) - 16384).astype(dtype)
    else:
      data = ((h >> 8).astype(jnp.float32) * np.float32(2.0 ** -23) - 1).astype(dtype)
    if taps is None:
      return (data,)
    t_dtype, n_taps = taps
    t = (bits(salt ^ np.uint32(0x9E3779B9)) % np.uint32(n_taps + 1)).astype(jnp.int32) - 1
    return (t.astype(t_dtype), data)

  salt = np.uint32(0)
  # Lowered in a thread of its own, where no trace and no ensure_compile_time_eval of the
  # caller's (both belong to a thread) run the positions eagerly into a constant of the
  # program: as large as the input, and kept as long as the program is. Like the candidates
  # (tuning.Tuner._compile_all), it follows the process's default device and x64 setting,
  # not a caller's jax.default_device or enable_x64 context.
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    compiled = pool.submit(lambda: jax.jit(draw).lower(salt).compile()).result()
  return functools.partial(compiled, salt)


def trial_inputs(shape, dtype: str, taps=None) -> tuple:
  """A tuning trial's inputs, as concrete arrays (also while a jit trace is running): values of
  ``shape`` and ``dtype`` (floats in ``[-1, 1]``, integers in ``[-2^14, 2^14)`` wrapped to the
  dtype) and, with ``taps = (dtype, n)``, taps in ``[-1, n)`` of that shape before them.

  From a hash of each element's position, by one compiled program per shape, dtype and taps
  (shared by the kernels that take them): random bits drawn op by op (as
  ``ensure_compile_time_eval`` runs ``jax.random``) took 6-21 s for a large input on an H100,
  most of a kernel's tuning budget (docs/design/launches.md)."""
  with jax.ensure_compile_time_eval():
    return tuple(_inputs_program(tuple(shape), dtype, taps)())
