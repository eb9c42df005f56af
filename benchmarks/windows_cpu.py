"""Max pooling with small to large windows on this machine's CPU: jaxpool over
``lax.reduce_window``, cell by cell (``windows_gpu.py``'s sweep, smaller).

Usage (from the repository root)::

  PYTHONPATH=$PWD python3 benchmarks/windows_cpu.py [--parts 2d_float32,3d_float32,spp] [--quick]

2-D windows k x k for k in {3, 5, 7, 9, 13} on (4, 32, 32, 16), 3-D windows k x k x k for k in
{2, 3, 5} on (1, 16, 16, 16, 8), strides {1, 2, k // 2, k}, ``"SAME"`` padding; the SPP part on
(2, 20, 20, 64), the 3-D target (7x7x7, stride 1) on (1, 16, 16, 16, 8), the SPPF step on
(2, 20, 20, 64). Timer, reruns and the JSON's layout as ``windows_gpu.py``; saved to
``benchmarks/results/windows_cpu.json`` (``--quick``: under ``build/benchmarks/``; ``--out``
overrides).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import windows_gpu  # noqa: E402

CPU = dict(windows_2d=(3, 5, 7, 9, 13), windows_3d=(2, 3, 5), shape_2d=(4, 32, 32, 16),
           shape_3d=(1, 16, 16, 16, 8), spp_shape=(2, 20, 20, 64),
           target_3d_shape=(1, 16, 16, 16, 8), sppf_shape=(2, 20, 20, 64), script="windows_cpu")


def main(argv=None) -> int:
  return windows_gpu.main(argv, defaults=CPU)


if __name__ == "__main__":
  sys.exit(main())
