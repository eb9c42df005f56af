"""jaxpool.graph: compose pooling and convolution nodes into graphs, derive their training graphs.

A lightweight, pure-JAX take on Apple's ``MPSNNGraph``: nodes are frozen, hashable descriptions;
a :class:`Graph` is a topologically ordered tuple of them with ``init``/``apply``; parameters are
a separate pytree keyed by node name; :func:`training_graph` builds the gradient nodes explicitly.
See ``docs/graph.md``.
"""

from jaxpool._src.graph import ACTIVATIONS as ACTIVATIONS
from jaxpool._src.graph import Activation as Activation
from jaxpool._src.graph import Add as Add
from jaxpool._src.graph import AvgPool as AvgPool
from jaxpool._src.graph import Concat as Concat
from jaxpool._src.graph import Conv as Conv
from jaxpool._src.graph import ConvTranspose as ConvTranspose
from jaxpool._src.graph import ConvolutionGradient as ConvolutionGradient
from jaxpool._src.graph import DEFAULT_PASSES as DEFAULT_PASSES
from jaxpool._src.graph import Cotangents as Cotangents
from jaxpool._src.graph import Dense as Dense
from jaxpool._src.graph import DilatedMaxPool as DilatedMaxPool
from jaxpool._src.graph import Flatten as Flatten
from jaxpool._src.graph import Gradient as Gradient
from jaxpool._src.graph import GradientNode as GradientNode
from jaxpool._src.graph import GradientState as GradientState
from jaxpool._src.graph import Graph as Graph
from jaxpool._src.graph import Image as Image
from jaxpool._src.graph import Initializer as Initializer
from jaxpool._src.graph import Input as Input
from jaxpool._src.graph import L2Pool as L2Pool
from jaxpool._src.graph import MaxPool as MaxPool
from jaxpool._src.graph import MeanSquaredError as MeanSquaredError
from jaxpool._src.graph import Node as Node
from jaxpool._src.graph import Pad as Pad
from jaxpool._src.graph import PoolingGradient as PoolingGradient
from jaxpool._src.graph import ReLU as ReLU
from jaxpool._src.graph import Reshape as Reshape
from jaxpool._src.graph import SigmoidCrossEntropy as SigmoidCrossEntropy
from jaxpool._src.graph import Softmax as Softmax
from jaxpool._src.graph import fold_relu_into_max_pool as fold_relu_into_max_pool
from jaxpool._src.graph import SoftmaxCrossEntropy as SoftmaxCrossEntropy
from jaxpool._src.graph import TrainingGraph as TrainingGraph
from jaxpool._src.graph import Upsample as Upsample
from jaxpool._src.graph import has_graphviz as has_graphviz
from jaxpool._src.graph import resolve_padding as resolve_padding
from jaxpool._src.graph import training_graph as training_graph
from jaxpool._src.graph import BatchNorm as BatchNorm
from jaxpool._src.graph import BatchNormalizationGradient as BatchNormalizationGradient
from jaxpool._src.graph import BatchNormalizationState as BatchNormalizationState
from jaxpool._src.graph import Dropout as Dropout
from jaxpool._src.graph import DropoutGradient as DropoutGradient
from jaxpool._src.graph import DropoutGradientState as DropoutGradientState
from jaxpool._src.graph import load_params as load_params
from jaxpool._src.graph.serialization import ParamsFileError as ParamsFileError
from jaxpool._src.graph import save_params as save_params

__all__ = [
    "Activation", "ACTIVATIONS", "Add", "AvgPool", "BatchNorm", "BatchNormalizationGradient",
    "BatchNormalizationState", "Concat", "Conv", "ConvolutionGradient", "ConvTranspose",
    "Cotangents", "DEFAULT_PASSES", "Dense", "DilatedMaxPool", "Dropout", "DropoutGradient",
    "DropoutGradientState", "Flatten", "fold_relu_into_max_pool", "Gradient", "GradientNode",
    "GradientState", "Graph", "has_graphviz", "Image", "Initializer", "Input", "L2Pool",
    "load_params", "MaxPool", "MeanSquaredError", "Node", "Pad", "ParamsFileError",
    "PoolingGradient", "ReLU", "Reshape", "resolve_padding", "save_params", "SigmoidCrossEntropy",
    "Softmax", "SoftmaxCrossEntropy", "training_graph", "TrainingGraph", "Upsample",
]
