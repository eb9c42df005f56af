"""The node/graph module (``jaxpool.graph``): MPSNNGraph-style nodes and training graphs.

Layout (each module imports only the ones above it in this list, never back):

- ``base.py``: :class:`Node`, input fields, the checks nodes share (windows, strides and padding
  through the core's ``jaxpool._src.windows``), and the registry of gradient classes.
- one module per kind of layer: ``inputs.py`` (Input), ``conv.py`` (Conv, ConvTranspose,
  Dense), ``pooling.py`` (the pools), ``activation.py`` (neurons, Softmax), ``arithmetic.py``
  (Add), ``shape.py`` (Flatten, Reshape, Pad, Concat, Upsample), ``losses.py``
  (SoftmaxCrossEntropy, SigmoidCrossEntropy, MeanSquaredError).
- ``gradients.py``: gradient-state and gradient nodes (it registers them with ``base.py``).
- ``graph.py``: :class:`Graph`, :class:`TrainingGraph`, :func:`training_graph`.
"""

from jaxpool._src.graph.activation import ACTIVATIONS, Activation, ReLU, Softmax
from jaxpool._src.graph.arithmetic import Add
from jaxpool._src.graph.base import Initializer, Node, resolve_padding
from jaxpool._src.graph.conv import Conv, ConvTranspose, Dense
from jaxpool._src.graph.gradients import (ConvolutionGradient, Cotangents, Gradient,
                                          GradientNode, GradientState, PoolingGradient)
from jaxpool._src.graph.graph import Graph, TrainingGraph, has_graphviz, training_graph
from jaxpool._src.graph.inputs import Image, Input
from jaxpool._src.graph.losses import MeanSquaredError, SigmoidCrossEntropy, SoftmaxCrossEntropy
from jaxpool._src.graph.pooling import AvgPool, DilatedMaxPool, L2Pool, MaxPool
from jaxpool._src.graph.shape import Concat, Flatten, Pad, Reshape, Upsample

__all__ = [
    "ACTIVATIONS", "Activation", "Add", "AvgPool", "Concat", "Conv", "ConvTranspose",
    "ConvolutionGradient", "Cotangents", "Dense", "DilatedMaxPool", "Flatten", "Gradient",
    "GradientNode", "GradientState", "Graph", "Image", "Initializer", "Input", "L2Pool",
    "MaxPool", "MeanSquaredError", "Node", "Pad", "PoolingGradient", "ReLU", "Reshape",
    "SigmoidCrossEntropy", "Softmax", "SoftmaxCrossEntropy", "TrainingGraph", "Upsample",
    "has_graphviz", "resolve_padding", "training_graph",
]
