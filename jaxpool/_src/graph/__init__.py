"""The node/graph module (``jaxpool.graph``): MPSNNGraph-style nodes and training graphs.

Layout (each module imports only the ones above it in this list, never back):

- ``base.py``: :class:`Node`, input fields, the checks nodes share (windows, strides and padding
  through the core's ``jaxpool._src.windows``), and the registry of gradient classes.
- one module per kind of layer: ``inputs.py`` (Input), ``conv.py`` (Conv, Dense),
  ``pooling.py`` (the pools), ``activation.py`` (neurons), ``arithmetic.py`` (Add),
  ``shape.py`` (Flatten), ``losses.py`` (SoftmaxCrossEntropy).
- ``gradients.py``: gradient-state and gradient nodes (it registers them with ``base.py``).
- ``passes.py``: the rewrite passes a graph applies before it runs (a ReLU into the max pool
  after it).
- ``graph.py``: :class:`Graph`, :class:`TrainingGraph`, :func:`training_graph`.
"""

from jaxpool._src.graph.activation import ACTIVATIONS, Activation, ReLU
from jaxpool._src.graph.arithmetic import Add
from jaxpool._src.graph.base import Node, resolve_padding
from jaxpool._src.graph.conv import Conv, Dense
from jaxpool._src.graph.gradients import (ConvolutionGradient, Cotangents, Gradient,
                                          GradientNode, GradientState, PoolingGradient)
from jaxpool._src.graph.graph import Graph, TrainingGraph, has_graphviz, training_graph
from jaxpool._src.graph.passes import DEFAULT_PASSES, fold_relu_into_max_pool
from jaxpool._src.graph.inputs import Image, Input
from jaxpool._src.graph.losses import SoftmaxCrossEntropy
from jaxpool._src.graph.pooling import AvgPool, DilatedMaxPool, L2Pool, MaxPool
from jaxpool._src.graph.shape import Flatten

__all__ = [
    "ACTIVATIONS", "Activation", "Add", "AvgPool", "Conv", "ConvolutionGradient", "Cotangents",
    "DEFAULT_PASSES", "Dense", "DilatedMaxPool", "Flatten", "Gradient", "GradientNode",
    "GradientState", "Graph", "Image", "Input", "L2Pool", "MaxPool", "Node", "PoolingGradient",
    "ReLU", "SoftmaxCrossEntropy", "TrainingGraph", "fold_relu_into_max_pool", "has_graphviz",
    "resolve_padding", "training_graph",
]
