"""The node/graph module (``jaxpool.graph``): MPSNNGraph-style nodes and training graphs."""

from jaxpool._src.graph.gradients import (ConvolutionGradient, Cotangents, Gradient,
                                          GradientNode, GradientState, PoolingGradient)
from jaxpool._src.graph.graph import Graph, TrainingGraph, has_graphviz, training_graph
from jaxpool._src.graph.nodes import (ACTIVATIONS, Activation, Add, AvgPool, Conv, Dense,
                                      DilatedMaxPool, Flatten, Image, Input, L2Pool, MaxPool,
                                      Node, ReLU, SoftmaxCrossEntropy, resolve_padding)

__all__ = [
    "ACTIVATIONS", "Activation", "Add", "AvgPool", "Conv", "ConvolutionGradient", "Cotangents",
    "Dense", "DilatedMaxPool", "Flatten", "Gradient", "GradientNode", "GradientState", "Graph",
    "Image", "Input", "L2Pool", "MaxPool", "Node", "PoolingGradient", "ReLU",
    "SoftmaxCrossEntropy", "TrainingGraph", "has_graphviz", "resolve_padding", "training_graph",
]
