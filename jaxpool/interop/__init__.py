"""Drop-in pooling layers for Flax (linen and nnx) and Equinox.

Each submodule imports its framework, so import the one you use (the core ``jaxpool`` imports
none of them; install them with ``pip install "jaxpool[interop]"``)::

  from jaxpool.interop import flax_linen   # MaxPool, MinPool, AvgPool, LPPool, L2Pool; functions
  from jaxpool.interop import flax_nnx     # the same as nnx.Modules
  from jaxpool.interop import equinox      # MaxPool1d/2d/3d, AvgPool1d/2d/3d, LPPool1d/2d/3d

The layers keep the names, argument names, argument forms and defaults of the framework they
come from, and add jaxpool's options (``dilation``, ``ceil_mode``, ``count_include_pad``,
``divisor_override``, ``implementation``; ``data_format`` for the Flax layers) as keyword
arguments. Their arguments are checked at construction and errors name them as written. Where a
framework and PyTorch differ, the layer follows the framework (Equinox's ceil-mode divisor
included), except Equinox's ceil-mode output size and a padding as large as the window;
docs/interop.md lists what is accepted and every difference.
"""
