"""The node/graph module (``jaxpool.graph``): MPSNNGraph-style nodes and training graphs.

Layout (each module imports only the ones above it in this list, never back):

- ``base.py``: :class:`Node`, input fields, and the base types of the gradient side
  (:class:`GradientState`, :class:`GradientNode`, :class:`Gradient`, :class:`Cotangents`).
- ``common.py``: the checks the node modules share (windows, strides and padding through the
  core's ``jaxpool._src.checks`` and ``jaxpool._src.windows``), image layout helpers,
  :class:`Initializer`.
- one module per kind of layer, each with its own gradient and gradient-state classes beside
  the node that names them (``gradient_class``, ``state_class``): ``inputs.py`` (Input),
  ``conv.py`` (Conv, ConvTranspose, Dense; ConvolutionGradient), ``pooling.py`` (the pools;
  PoolingGradient), ``activation.py`` (neurons, Softmax), ``arithmetic.py`` (Add), ``shape.py``
  (Flatten, Reshape, Pad, Concat, Upsample), ``losses.py`` (SoftmaxCrossEntropy,
  SigmoidCrossEntropy, MeanSquaredError), ``normalization.py`` (BatchNorm and its gradient and
  state), ``regularization.py`` (Dropout and its gradient and state).
- ``passes.py``: the rewrite passes a graph applies before it runs (a ReLU into the max pool
  after it).
- ``building.py`` (a graph's nodes collected from its outputs, ordered, their specs inferred),
  ``run_checks.py`` (the inputs and parameters a run is given, checked) and ``drawing.py``
  (``summary``, ``to_dot``, ``save``): what ``graph.py`` uses.
- ``graph.py``: :class:`Graph`.
- ``training.py``: :class:`TrainingGraph` and :func:`training_graph`, which derives a loss's
  gradient nodes.
- ``serialization.py``: :func:`save_params`, :func:`load_params` (it imports nothing above).
"""

from jaxpool._src.graph.activation import ACTIVATIONS, Activation, ReLU, Softmax
from jaxpool._src.graph.arithmetic import Add
from jaxpool._src.graph.base import Cotangents, Gradient, GradientNode, GradientState, Node
from jaxpool._src.graph.common import Initializer, resolve_padding
from jaxpool._src.graph.conv import Conv, ConvTranspose, ConvolutionGradient, Dense
from jaxpool._src.graph.drawing import has_graphviz
from jaxpool._src.graph.graph import Graph
from jaxpool._src.graph.passes import DEFAULT_PASSES, fold_relu_into_max_pool
from jaxpool._src.graph.inputs import Image, Input
from jaxpool._src.graph.losses import MeanSquaredError, SigmoidCrossEntropy, SoftmaxCrossEntropy
from jaxpool._src.graph.normalization import (BatchNorm, BatchNormalizationGradient,
                                              BatchNormalizationState)
from jaxpool._src.graph.pooling import AvgPool, DilatedMaxPool, L2Pool, MaxPool, PoolingGradient
from jaxpool._src.graph.regularization import Dropout, DropoutGradient, DropoutGradientState
from jaxpool._src.graph.serialization import load_params, save_params
from jaxpool._src.graph.shape import Concat, Flatten, Pad, Reshape, Upsample
from jaxpool._src.graph.training import TrainingGraph, training_graph

__all__ = [
    "ACTIVATIONS", "Activation", "Add", "AvgPool", "BatchNorm", "BatchNormalizationGradient",
    "BatchNormalizationState", "Concat", "Conv", "ConvTranspose", "ConvolutionGradient",
    "Cotangents", "DEFAULT_PASSES", "Dense", "DilatedMaxPool", "Dropout", "DropoutGradient",
    "DropoutGradientState", "Flatten", "Gradient", "GradientNode", "GradientState", "Graph",
    "Image", "Initializer", "Input", "L2Pool", "MaxPool", "MeanSquaredError", "Node", "Pad",
    "PoolingGradient", "ReLU", "Reshape", "SigmoidCrossEntropy", "Softmax",
    "SoftmaxCrossEntropy", "TrainingGraph", "Upsample", "fold_relu_into_max_pool",
    "has_graphviz", "load_params",
    "resolve_padding", "save_params", "training_graph",
]
