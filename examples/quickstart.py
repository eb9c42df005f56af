"""A tour of jaxpool's functional API (runs on CPU in a few seconds).

    python examples/quickstart.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxpool


def show(title, a):
  print(f"{title}:\n{np.asarray(a)}\n")


def main():
  # DirectML's documented example: a 2x2 max pool, stride 1, and its gradient.
  x = jnp.array([[1., 2., 3.], [2., 4., 2.], [5., 6., 7.]])[None, :, :, None]  # (N, H, W, C)
  y, idx = jaxpool.max_pool_with_indices(x, (2, 2))
  show("max_pool 2x2/s1 of [[1,2,3],[2,4,2],[5,6,7]]", y[0, ..., 0])
  show("argmax indices (flat, row-major, PyTorch's convention)", idx[0, ..., 0])
  dy = jnp.array([[1., 2.], [4., 5.]])[None, :, :, None]
  show("max_pool_grad with dy=[[1,2],[4,5]] (overlaps summed)",
       jaxpool.max_pool_grad(x, dy, (2, 2))[0, ..., 0])
  show("max_unpool(y, idx)", jaxpool.max_unpool(y, idx, (3, 3))[0, ..., 0])

  # Ties go to the first element in row-major window order; NaN wins; padding never wins.
  t = jnp.array([[3., 3.], [3., 3.]])[None, :, :, None]
  g = jax.grad(lambda t: jaxpool.max_pool(t, (2, 2)).sum())(t)
  show("gradient of a 2x2 window of ties (goes to the first)", g[0, ..., 0])

  # A training-loop shape: 3x3/s2/p1 (ResNet's stem), channels_last, under jit, vmap and grad.
  key = jax.random.key(0)
  x = jax.random.normal(key, (8, 32, 32, 16))
  pool = jax.jit(lambda x: jaxpool.max_pool(x, (3, 3), (2, 2), 1))
  print("ResNet stem pool:", x.shape, "->", pool(x).shape)
  per_example = jax.vmap(jax.grad(lambda xi: jaxpool.max_pool(xi, (3, 3), (2, 2), 1).sum()))(x)
  print("per-example gradients (vmap of grad):", per_example.shape)
  _, tangent = jax.jvp(lambda x: jaxpool.max_pool(x, (3, 3), (2, 2), 1), (x,), (jnp.ones_like(x),))
  print("forward mode (jvp) works:", tangent.shape)

  # Dilated max pooling has a gradient (lax.reduce_window's raises NotImplementedError).
  gd = jax.grad(lambda x: jaxpool.max_pool(x, (2, 2), dilation=(2, 2)).sum())(x)
  print("dilated max-pool gradient:", gd.shape, "nonzeros:", int((gd != 0).sum()))

  # PyTorch's average divisors and ceil mode.
  ones = jnp.ones((1, 5, 5, 1))
  for cip in (True, False):
    a = jaxpool.avg_pool(ones, (2, 2), (2, 2), 1, ceil_mode=True, count_include_pad=cip)
    show(f"avg_pool of ones, 2x2/s2/p1, ceil_mode, count_include_pad={cip}", a[0, ..., 0])

  # L2 pooling (MPS's L2-norm pooling) and Lp pooling; channels_first layout.
  v = jnp.array([[3., 4., 0., 0.]])[None]  # (N, C, L)
  show("l2_pool of [3,4,0,0], window 2, stride 2 (channels_first)",
       jaxpool.l2_pool(v, (2,), (2,), data_format="channels_first")[0, 0])
  show("its gradient (0 where the output is 0, never NaN)",
       jax.grad(lambda v: jaxpool.l2_pool(v, (2,), (2,), data_format="channels_first").sum())(v)
       [0, 0])


if __name__ == "__main__":
  main()
