"""Reliability: no size kills the process, no parameter file misleads, no zero makes a NaN.

Each section was a bug (issue 26): a huge ``output_size`` built its tables (GiBs) before any
check; ``load_params`` answered a bad file with whatever NumPy, zipfile or json raised (and
NumPy's advice to allow pickle); a float shape was truncated silently; a zero cotangent times an
infinite input made a NaN in the Lp gradient.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpool

# ----------------------------------------------------------------------------- Lp: inf and NaN


def _lp_reference(x, dy, p, window, strides, padding, dilation):
  """``(y, dx)`` of Lp pooling on ``x: (N, *spatial, C)`` in float64, written from the rule in
  docs/semantics.md, one window at a time (no jaxpool code): a window with a NaN outputs NaN,
  else one with an infinity outputs inf; the window's largest elements (its NaNs, else its
  infinities) get ``sign(x)`` (1 for NaN) times the cotangent, the others the limit of
  ``sign(x) (|x|/y)^(p-1)``: 0 for p > 1, ``sign(x)`` for p == 1."""
  x = np.asarray(x, np.float64)
  spatial = x.shape[1:-1]
  out = [(L + lo + hi - d * (k - 1) - 1) // s + 1
         for L, (lo, hi), k, s, d in zip(spatial, padding, window, strides, dilation)]
  y = np.zeros((x.shape[0], *out, x.shape[-1]))
  dx = np.zeros_like(x)
  reached = np.zeros(x.shape, bool)
  for n, c in itertools.product(range(x.shape[0]), range(x.shape[-1])):
    for o in itertools.product(*map(range, out)):
      elems = []
      for t in itertools.product(*map(range, window)):
        pos = tuple(oi * s + ti * d - lo for oi, ti, s, d, (lo, _) in
                    zip(o, t, strides, dilation, padding))
        if all(0 <= q < L for q, L in zip(pos, spatial)):
          elems.append((n, *pos, c))
      v = np.array([x[e] for e in elems])
      g = dy[(n, *o, c)]
      if np.isnan(v).any():
        yo, top = np.nan, np.isnan(v)
      elif np.isinf(v).any():
        yo, top = np.inf, np.isinf(v)
      else:
        m = np.abs(v).max() if v.size else 0.0
        yo = 0.0 if m == 0 else m * np.sum((np.abs(v) / m) ** p) ** (1 / p)
        top = None
      y[(n, *o, c)] = yo
      for i, e in enumerate(elems):
        if top is not None:  # NaN or inf window
          sign = 1.0 if np.isnan(v[i]) else np.sign(v[i])
          w = sign if (top[i] or p == 1) else 0.0
        elif yo == 0:
          w = 0.0
        else:
          w = np.sign(v[i]) * (abs(v[i]) / yo) ** (p - 1)
        dx[e] += g * w
        reached[e] |= g != 0
  return y, dx, reached


LP_CONFIGS = [
    # window, strides, padding, dilation, input spatial
    ((2,), (2,), ((0, 0),), (1,), (10,)),
    ((3,), (1,), ((1, 1),), (1,), (9,)),
    ((2,), (1,), ((1, 0),), (2,), (8,)),
    ((2, 2), (1, 1), ((0, 1), (1, 0)), (1, 1), (4, 5)),
    ((2, 3), (2, 1), ((1, 1), (0, 2)), (1, 2), (5, 6)),
]


@pytest.mark.parametrize("p", [1, 1.5, 2, 3])
@pytest.mark.parametrize("cfg", LP_CONFIGS, ids=lambda c: f"w{c[0]}s{c[1]}d{c[3]}")
def test_lp_gradient_with_inf_and_nan_matches_reference(rng, p, cfg):
  window, strides, padding, dilation, spatial = cfg
  shape = (2, *spatial, 2)
  x = rng.uniform(-3, 3, shape).astype(np.float32)
  special = rng.choice(np.array([np.inf, -np.inf, np.nan], np.float32), shape)
  x = np.where(rng.random(shape) < 0.2, special, x)
  kw = dict(strides=strides, padding=padding, dilation=dilation)
  y = jaxpool.lp_pool(x, p, window, **kw)
  dy = rng.uniform(0.5, 2, y.shape).astype(np.float32)
  dy = np.where(rng.random(y.shape) < 0.5, np.float32(0), dy)  # zero cotangents
  y_ref, dx_ref, reached = _lp_reference(x, dy, p, window, strides, padding, dilation)
  np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-5, atol=1e-6)
  _, vjp = jax.vjp(lambda v: jaxpool.lp_pool(v, p, window, **kw), jnp.asarray(x))
  for dx in (vjp(jnp.asarray(dy))[0], jaxpool.lp_pool_grad(x, dy, p, window, **kw)):
    dx = np.asarray(dx)
    assert np.isfinite(dx).all(), dx
    assert (dx[~reached] == 0).all()  # exactly 0 where no nonzero cotangent reaches
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("p", [1, 2, 3])
def test_lp_forward_mode_with_inf_and_nan(p):
  """Forward mode is the same rule: a zero tangent gives exactly 0, and jacfwd == jacrev."""
  x = jnp.array([jnp.inf, 1., 3., 4., jnp.nan, 2., -jnp.inf, 5., 0., 0.]).reshape(1, 10, 1)
  f = lambda v: jaxpool.lp_pool(v, p, (2,), (2,))
  jf, jr = jax.jacfwd(f)(x), jax.jacrev(f)(x)
  assert np.isfinite(np.asarray(jf)).all()
  np.testing.assert_array_equal(np.asarray(jf), np.asarray(jr))


def test_lp_issue_example_is_zero_outside_the_window():
  v = jnp.array([jnp.inf, 1., 3., 4.]).reshape(1, 4, 1)
  g = jax.grad(lambda v: jaxpool.lp_pool(v, 2, (2,), (2,))[0, 1, 0])(v)
  g = np.asarray(g)[0, :, 0]
  np.testing.assert_array_equal(g[:2], [0., 0.])  # was [nan, 0]: 0 * inf
  np.testing.assert_allclose(g[2:], [0.6, 0.8], rtol=1e-6)
