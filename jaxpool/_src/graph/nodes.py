"""Forward nodes: frozen, hashable descriptions of one operation each.

A node is an op, its static config and the names of its input nodes (``inputs``). It keeps the
input node objects it was built from (``refs``, not compared, not hashed) only so that
:class:`~jaxpool.graph.Graph` can find every node from the outputs; an input may also be given by
name, which is resolved when the graph is built. Nodes never hold arrays: parameters live in a
separate pytree keyed by node name.

Every array a node sees is ``(*batch, *shape)`` where ``shape`` is the per-example shape the graph
infers at build time (images are channels-last, ``(*spatial, C)``); the batch dims are whatever the
caller passes (none under ``vmap``, as MPS's ``encodeBatch``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, ClassVar, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxpool
from jaxpool._src import xla
from jaxpool._src.windows import taps_dtype

Ref = Union["Node", str]
Spec = jax.ShapeDtypeStruct
Params = dict[str, jax.Array]

PADDING_POLICIES = ("VALID", "SAME", "FULL")
ACCUMULATOR_PRECISIONS = ("float", "half")


def _input(compare: bool = False, **kw: Any) -> Any:
  """A field that names an input node (a node or a name); only its name is compared."""
  return field(compare=compare, repr=False, hash=False if not compare else None, **kw)


@dataclass(frozen=True)
class Node:
  """Base class of every node.

  Attributes:
    name: unique within a graph; the key of the node's parameters and its ``named_scope``.
    inputs: names of the input nodes, in order (derived from the input fields).
  """

  name: str
  inputs: tuple[str, ...] = field(init=False, default=())
  refs: tuple[Node, ...] = field(init=False, default=(), compare=False, repr=False, hash=False)

  _input_fields: ClassVar[tuple[str, ...]] = ("source",)
  has_params: ClassVar[bool] = False
  keeps_state: ClassVar[bool] = False  # whether its gradient needs a gradient-state node
  state_doc: ClassVar[str] = ""        # what the gradient state carries

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"a node name must be a non-empty str; got {self.name!r}.")
    names, refs = [], []
    for f in self._input_fields:
      for ref in _as_refs(getattr(self, f)):
        names.append(_ref_name(self.name, f, ref))
        if isinstance(ref, Node):
          refs.append(ref)
    object.__setattr__(self, "inputs", tuple(names))
    object.__setattr__(self, "refs", tuple(refs))
    self._normalize()

  def _normalize(self) -> None:
    """Checks and canonicalises the static config (lists -> tuples); raises ValueError."""

  def _set(self, attr: str, value: Any) -> None:
    object.__setattr__(self, attr, value)

  def _fail(self, msg: str, exc: type[Exception] = ValueError) -> Exception:
    return exc(f"node {self.name!r} ({type(self).__name__}): {msg}")

  # -- shapes and parameters -------------------------------------------------------------------

  def param_specs(self, in_specs: tuple[Spec, ...]) -> dict[str, Spec] | None:
    """The shapes of this node's parameters for these per-example input specs."""
    return None

  def init_params(self, key: jax.Array, in_specs: tuple[Spec, ...]) -> Params | None:
    return None

  def infer(self, in_specs: tuple[Spec, ...]) -> Spec:
    """The per-example output spec; raises ValueError for inputs the node cannot take."""
    self.check_inputs(in_specs)
    pspecs = self.param_specs(in_specs)
    return jax.eval_shape(lambda p, *xs: self.forward(p, xs, in_specs), pspecs, *in_specs)

  def check_inputs(self, in_specs: tuple[Spec, ...]) -> None:
    """Explicit shape checks with readable messages, run before shape inference."""

  # -- running ---------------------------------------------------------------------------------

  def forward(self, params: Params | None, xs: tuple[jax.Array, ...],
              in_specs: tuple[Spec, ...]) -> jax.Array:
    raise NotImplementedError(type(self).__name__)

  def forward_with_state(self, params: Params | None, xs: tuple[jax.Array, ...],
                         in_specs: tuple[Spec, ...]) -> tuple[jax.Array, Any]:
    """The forward pass plus what its gradient needs (the gradient state)."""
    return self.forward(params, xs, in_specs), (params if self.has_params else None)

  def state_spec(self, in_specs: tuple[Spec, ...]) -> Any:
    pspecs = self.param_specs(in_specs)
    return jax.eval_shape(lambda p, *xs: self.forward_with_state(p, xs, in_specs)[1], pspecs,
                          *in_specs)

  def backward(self, xs: tuple[jax.Array, ...], state: Any, dy: jax.Array,
               in_specs: tuple[Spec, ...], wrt: tuple[bool, ...]
               ) -> tuple[tuple[jax.Array | None, ...], Params | None]:
    """Cotangents of the inputs (``None`` where ``wrt`` is false) and of the parameters.

    The default is ``jax.vjp`` of :meth:`forward` at the source images, with the parameters the
    forward used (its gradient state) for nodes that have parameters.
    """
    params = state if self.has_params else None
    idx = [k for k, w in enumerate(wrt) if w]

    def f(p, *diff):
      full = list(xs)
      for k, v in zip(idx, diff):
        full[k] = v
      return self.forward(p, tuple(full), in_specs)

    if params is None:
      y, vjp = jax.vjp(lambda *d: f(None, *d), *[xs[k] for k in idx])
      cts = vjp(jnp.asarray(dy).astype(y.dtype))
      dparams = None
    else:
      y, vjp = jax.vjp(f, params, *[xs[k] for k in idx])
      dparams, *cts = vjp(jnp.asarray(dy).astype(y.dtype))
    dxs: list[jax.Array | None] = [None] * len(xs)
    for k, c in zip(idx, cts):
      dxs[k] = c
    return tuple(dxs), dparams

  # -- MPS's gradient API ----------------------------------------------------------------------

  def gradient_state(self, name: str | None = None):
    """The gradient-state node that carries what this node's forward keeps for its gradient."""
    from jaxpool._src.graph.gradients import GradientState
    return GradientState(name or f"{self.name}.state", self)

  def gradient_filter(self, source_gradient: Ref | Sequence[Ref] | None = None, *,
                      state: Ref | None = None, name: str | None = None,
                      wrt: Sequence[bool] | None = None):
    """This node's gradient node, as MPS's ``gradientFilter(withSource:)``.

    Args:
      source_gradient: the node(s) giving the cotangent of this node's output (summed if
        several; a gradient node contributes its cotangent for this node). ``None`` only for a
        scalar output such as a loss (the seed 1).
      state: this node's gradient-state node (required where :attr:`keeps_state`); made here if
        omitted and needed.
      name: defaults to ``"<name>.grad"``.
      wrt: which inputs to differentiate (default: every float input).
    """
    from jaxpool._src.graph.gradients import gradient_class
    if state is None and self.keeps_state:
      state = self.gradient_state()
    cls = gradient_class(self)
    return cls(name or f"{self.name}.grad", self, source_gradient, self.refs_or_names(), state,
               wrt=None if wrt is None else check_bools(self, "wrt", wrt))

  def refs_or_names(self) -> tuple[Ref, ...]:
    """The inputs as node objects where known, else as names."""
    by_name = {r.name: r for r in self.refs}
    return tuple(by_name.get(n, n) for n in self.inputs)

  def describe(self) -> str:
    """A short description of the op for summaries and pictures."""
    return type(self).__name__


def _as_refs(value: Any) -> tuple[Any, ...]:
  if value is None:
    return ()
  if isinstance(value, (Node, str)):
    return (value,)
  if isinstance(value, (tuple, list)):
    return tuple(value)
  return (value,)


def _ref_name(owner: str, field_name: str, ref: Any) -> str:
  if isinstance(ref, Node):
    return ref.name
  if isinstance(ref, str) and ref:
    return ref
  raise TypeError(f"node {owner!r}: {field_name} must be a node or a node name; got {ref!r}.")


def _batch_shape(x: jax.Array, spec: Spec) -> tuple[int, ...]:
  return tuple(x.shape[:x.ndim - len(spec.shape)])


def _int_tuple(node: Node, name: str, value: Any, n: int | None, minimum: int = 1
               ) -> tuple[int, ...]:
  try:
    t = tuple(value)
  except TypeError:
    raise node._fail(f"{name} must be a tuple of ints; got {value!r}.", TypeError) from None
  if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in t):
    raise node._fail(f"{name} must be a tuple of ints; got {value!r}.", TypeError)
  if n is not None and len(t) != n:
    raise node._fail(f"{name} must have {n} entries, one per spatial dim; got {value!r}.")
  if any(v < minimum for v in t):
    raise node._fail(f"{name} entries must be >= {minimum}; got {value!r}.")
  return tuple(int(v) for v in t)


def _is_int(v: Any) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _check_bool(node: Node, name: str, value: Any) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise node._fail(f"{name} must be a bool (True or False); got {value!r}.", TypeError)
  return bool(value)


def check_bools(node: Node, name: str, value: Any) -> tuple[bool, ...]:
  """A sequence of bools (``wrt``), as a tuple; anything else is a TypeError naming ``node``."""
  try:
    items = tuple(value)
  except TypeError:
    raise node._fail(f"{name} must be a sequence of bools; got {value!r}.", TypeError) from None
  if not all(isinstance(w, (bool, np.bool_)) for w in items):
    raise node._fail(f"{name} must be a sequence of bools; got {value!r}.", TypeError)
  return tuple(bool(w) for w in items)


def _check_layer_config(node: Any) -> None:
  """``features``, ``use_bias``, ``accumulator_precision``, the initializers and ``param_dtype``
  of a :class:`Conv` or :class:`Dense`; canonicalises them in place."""
  if not _is_int(node.features):
    raise node._fail(f"features must be a positive int; got {node.features!r}"
                     + (" (a bool is not an int)." if isinstance(node.features, (bool, np.bool_))
                        else "."), TypeError)
  if node.features < 1:
    raise node._fail(f"features must be a positive int; got {node.features!r}.")
  node._set("features", int(node.features))
  node._set("use_bias", _check_bool(node, "use_bias", node.use_bias))
  if not isinstance(node.accumulator_precision, str):
    raise node._fail(f"accumulator_precision must be one of {ACCUMULATOR_PRECISIONS}; got "
                     f"{node.accumulator_precision!r}.", TypeError)
  if node.accumulator_precision not in ACCUMULATOR_PRECISIONS:
    raise node._fail(f"accumulator_precision must be one of {ACCUMULATOR_PRECISIONS}; got "
                     f"{node.accumulator_precision!r}.")
  for name in ("weights_init", "bias_init"):
    if not callable(getattr(node, name)):
      raise node._fail(f"{name} must be an initializer, a function (key, shape, dtype) -> array "
                       f"such as jax.nn.initializers.zeros; got {getattr(node, name)!r}.",
                       TypeError)
  node._set("param_dtype", _float_dtype(node, "param_dtype", node.param_dtype))


def _float_dtype(node: Node, name: str, value: Any) -> np.dtype:
  dt = _dtype(node, name, value)
  if not jnp.issubdtype(dt, jnp.floating):
    raise node._fail(f"{name} must be a float dtype; got {value!r}.", TypeError)
  return dt


def _dtype(node: Node, name: str, value: Any) -> np.dtype:
  if value is None:  # np.dtype(None) is float64: never what was meant
    raise node._fail(f"{name} must be a dtype; got None.", TypeError)
  try:
    return np.dtype(value)
  except TypeError:
    raise node._fail(f"{name} must be a dtype; got {value!r}.", TypeError) from None


def _padding_policy(node: Node, padding: Any, n: int) -> str | tuple[tuple[int, int], ...]:
  if isinstance(padding, str):
    if padding not in PADDING_POLICIES:
      raise node._fail(f"padding must be one of {PADDING_POLICIES} or (lo, hi) pairs; got "
                       f"{padding!r}.")
    return padding
  try:
    pairs = tuple(tuple(p) for p in padding)
  except TypeError:
    raise node._fail(f"padding must be one of {PADDING_POLICIES} or (lo, hi) pairs; got "
                     f"{padding!r}.", TypeError) from None
  if len(pairs) != n or any(len(p) != 2 for p in pairs):
    raise node._fail(f"padding must have one (lo, hi) pair per spatial dim ({n}); got "
                     f"{padding!r}.")
  for p in pairs:
    _int_tuple(node, "padding", p, 2, minimum=0)
  return tuple((int(lo), int(hi)) for lo, hi in pairs)


def resolve_padding(policy: str | tuple[tuple[int, int], ...], in_spatial: Sequence[int],
                    window: Sequence[int], strides: Sequence[int], dilation: Sequence[int]
                    ) -> tuple[tuple[int, int], ...]:
  """A padding policy as ``(lo, hi)`` pairs, one per spatial dim.

  ``"VALID"``: none. ``"SAME"``: ``ceil(L / s)`` outputs, the odd element of padding at the end
  (ONNX SAME_UPPER, as :func:`jaxpool.max_pool`). ``"FULL"``: ``e - 1`` on both sides (``e`` the
  effective window ``d * (k - 1) + 1``): every window that touches a real element.
  """
  eff = [d * (k - 1) + 1 for k, d in zip(window, dilation)]
  if policy == "VALID":
    return ((0, 0),) * len(window)
  if policy == "FULL":
    return tuple((e - 1, e - 1) for e in eff)
  if policy == "SAME":
    pads = []
    for L, s, e in zip(in_spatial, strides, eff):
      total = max((-(-L // s) - 1) * s + e - L, 0)
      pads.append((total // 2, total - total // 2))
    return tuple(pads)
  if isinstance(policy, str):
    raise ValueError(f"padding must be one of {PADDING_POLICIES} or (lo, hi) pairs; got "
                     f"{policy!r}.")
  return tuple(policy)


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Input(Node):
  """A named input image (MPS's ``MPSNNImageNode``): the caller passes it to ``apply``.

  Attributes:
    shape: the per-example shape, e.g. ``(H, W, C)``; arrays passed in may add leading batch dims.
    dtype: the dtype arrays are cast to (their kind, float or integer, must match).
  """

  shape: tuple[int, ...] = ()
  dtype: Any = jnp.float32
  _input_fields: ClassVar[tuple[str, ...]] = ()

  def _normalize(self):
    self._set("shape", _int_tuple(self, "shape", self.shape, None, minimum=0))
    self._set("dtype", _dtype(self, "dtype", self.dtype))

  def infer(self, in_specs):
    return Spec(self.shape, self.dtype)

  def describe(self):
    return f"Input {np.dtype(self.dtype).name}"


Image = Input


# ----------------------------------------------------------------------------- convolution


def _conv_precision(acc: str, dtype) -> dict[str, Any]:
  if acc == "float":
    return dict(precision=lax.Precision.HIGHEST, preferred_element_type=jnp.promote_types(
        dtype, jnp.float32))
  return dict(precision=lax.Precision.DEFAULT, preferred_element_type=None)


# One shared default, so that two nodes built with the same config compare (and hash) equal.
HE_NORMAL = jax.nn.initializers.he_normal()


@dataclass(frozen=True)
class Conv(Node):
  """A convolution (MPS's ``MPSCNNConvolutionNode``), channels-last, with bias.

  Parameters ``{"w": (*window, C_in, features), "b": (features,)}`` come from the initializers
  (the "data source"): ``weights_init(key, shape, dtype)``, ``bias_init(key, shape, dtype)``.

  Attributes:
    source: the input node, ``(*spatial, C_in)`` per example.
    features: output channels.
    window: kernel size per spatial dim (its length is the number of spatial dims).
    strides: per spatial dim; default ones.
    padding: ``"VALID"``, ``"SAME"``, ``"FULL"`` or ``(lo, hi)`` pairs (see ``docs/graph.md``).
    dilation: per spatial dim; default ones.
    use_bias: add ``b``.
    accumulator_precision: ``"float"`` (MPS's ``.float``): ``lax.Precision.HIGHEST`` and a
      float32 (at least) ``preferred_element_type``, the result cast back to the input dtype;
      ``"half"`` (MPS's ``.half``): ``lax.Precision.DEFAULT``, the backend's fastest (TF32/bf16
      passes on GPUs and TPUs).
    weights_init, bias_init: initializers, as ``jax.nn.initializers``.
    param_dtype: dtype of the parameters.
  """

  source: Ref = _input()
  _: KW_ONLY
  features: int = 1
  window: tuple[int, ...] = (3, 3)
  strides: tuple[int, ...] | None = None
  padding: Any = "SAME"
  dilation: tuple[int, ...] | None = None
  use_bias: bool = True
  accumulator_precision: str = "float"
  weights_init: Callable[..., jax.Array] = HE_NORMAL
  bias_init: Callable[..., jax.Array] = jax.nn.initializers.zeros
  param_dtype: Any = jnp.float32
  has_params: ClassVar[bool] = True
  keeps_state: ClassVar[bool] = True
  state_doc: ClassVar[str] = "weights, bias"

  def _normalize(self):
    n = len(_int_tuple(self, "window", self.window, None))
    if n == 0:
      raise self._fail("window must have at least one spatial dim; got ().")
    self._set("window", _int_tuple(self, "window", self.window, n))
    ones = (1,) * n  # only None means the default: a 0 is an error, not "ones"
    self._set("strides", _int_tuple(self, "strides",
                                    ones if self.strides is None else self.strides, n))
    self._set("dilation", _int_tuple(self, "dilation",
                                     ones if self.dilation is None else self.dilation, n))
    self._set("padding", _padding_policy(self, self.padding, n))
    _check_layer_config(self)

  @property
  def nspatial(self) -> int:
    return len(self.window)

  def check_inputs(self, in_specs):
    (x,) = in_specs
    if len(x.shape) != self.nspatial + 1:
      raise self._fail(
          f"input {self.inputs[0]!r} must be (*spatial, C) with {self.nspatial} spatial dims "
          f"(window {self.window}); got shape {x.shape}.")
    pads = self._pads(x.shape)
    for i, (L, (lo, hi), k, d) in enumerate(zip(x.shape, pads, self.window, self.dilation)):
      if L + lo + hi < d * (k - 1) + 1:
        raise self._fail(f"window {self.window} (dilation {self.dilation}) is larger than the "
                         f"padded input {x.shape} in spatial dim {i}.")

  def _pads(self, shape):
    return resolve_padding(self.padding, shape[:-1], self.window, self.strides, self.dilation)

  def param_specs(self, in_specs):
    c_in = in_specs[0].shape[-1]
    specs = {"w": Spec((*self.window, c_in, self.features), self.param_dtype)}
    if self.use_bias:
      specs["b"] = Spec((self.features,), self.param_dtype)
    return specs

  def init_params(self, key, in_specs):
    kw, kb = jax.random.split(key)
    specs = self.param_specs(in_specs)
    params = {"w": self.weights_init(kw, specs["w"].shape, specs["w"].dtype)}
    if self.use_bias:
      params["b"] = self.bias_init(kb, specs["b"].shape, specs["b"].dtype)
    return params

  def forward(self, params, xs, in_specs):
    (x,), (spec,) = xs, in_specs
    n = self.nspatial
    batch = _batch_shape(x, spec)
    xb = x.reshape((-1, *spec.shape))
    dn = lax.ConvDimensionNumbers(lhs_spec=(0, n + 1, *range(1, n + 1)),
                                  rhs_spec=(n + 1, n, *range(n)),
                                  out_spec=(0, n + 1, *range(1, n + 1)))
    y = lax.conv_general_dilated(
        xb, params["w"].astype(x.dtype), window_strides=self.strides,
        padding=self._pads(spec.shape), rhs_dilation=self.dilation, dimension_numbers=dn,
        **_conv_precision(self.accumulator_precision, x.dtype))
    if self.use_bias:
      y = y + params["b"].astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))
    y = y.astype(x.dtype)
    return y.reshape((*batch, *y.shape[1:]))

  def describe(self):
    pad = self.padding if isinstance(self.padding, str) else f"pad {self.padding}"
    return (f"Conv {'x'.join(map(str, self.window))}/{'x'.join(map(str, self.strides))} "
            f"{pad} -> {self.features}")


@dataclass(frozen=True)
class Dense(Node):
  """A fully connected layer that flattens the per-example dims of what it gets.

  Parameters ``{"w": (prod(in_shape), features), "b": (features,)}``.

  Attributes:
    source: the input node, any per-example shape.
    features, use_bias, accumulator_precision, weights_init, bias_init, param_dtype: as
      :class:`Conv`.
  """

  source: Ref = _input()
  _: KW_ONLY
  features: int = 1
  use_bias: bool = True
  accumulator_precision: str = "float"
  weights_init: Callable[..., jax.Array] = HE_NORMAL
  bias_init: Callable[..., jax.Array] = jax.nn.initializers.zeros
  param_dtype: Any = jnp.float32
  has_params: ClassVar[bool] = True
  keeps_state: ClassVar[bool] = True
  state_doc: ClassVar[str] = "weights, bias"

  def _normalize(self):
    _check_layer_config(self)

  def param_specs(self, in_specs):
    specs = {"w": Spec((math.prod(in_specs[0].shape), self.features), self.param_dtype)}
    if self.use_bias:
      specs["b"] = Spec((self.features,), self.param_dtype)
    return specs

  init_params = Conv.init_params

  def forward(self, params, xs, in_specs):
    (x,), (spec,) = xs, in_specs
    batch = _batch_shape(x, spec)
    xf = x.reshape((*batch, math.prod(spec.shape)))
    y = jnp.matmul(xf, params["w"].astype(x.dtype),
                   **_conv_precision(self.accumulator_precision, x.dtype))
    if self.use_bias:
      y = y + params["b"].astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))
    return y.astype(x.dtype)

  def describe(self):
    return f"Dense -> {self.features}"


# ----------------------------------------------------------------------------- pooling


@dataclass(frozen=True)
class _Pool(Node):
  """Shared config of the pooling nodes (MPS's ``MPSCNNPoolingNode``)."""

  source: Ref = _input()
  _: KW_ONLY
  window: tuple[int, ...] = (2, 2)
  strides: tuple[int, ...] | None = None
  padding: Any = "VALID"
  offset: tuple[int, ...] | None = None

  def _normalize(self):
    n = len(_int_tuple(self, "window", self.window, None))
    if n == 0:
      raise self._fail("window must have at least one spatial dim; got ().")
    self._set("window", _int_tuple(self, "window", self.window, n))
    # MPS's init(source:filterSize:) sets the stride to the filter size.
    self._set("strides", _int_tuple(self, "strides",
                                    self.window if self.strides is None else self.strides, n))
    self._set("padding", _padding_policy(self, self.padding, n))
    off = (0,) * n if self.offset is None else self.offset
    self._set("offset", _int_tuple(self, "offset", off, n, minimum=-(2 ** 31)))
    if hasattr(self, "dilation"):
      dilation = (1,) * n if self.dilation is None else self.dilation
      self._set("dilation", _int_tuple(self, "dilation", dilation, n))

  @property
  def nspatial(self) -> int:
    return len(self.window)

  @property
  def dilation_(self) -> tuple[int, ...]:
    return getattr(self, "dilation", None) or (1,) * self.nspatial

  def geometry(self, spatial: Sequence[int]):
    """``(crop, pads)``: what to cut from each side of the input, then jaxpool's ``(lo, hi)``.

    The policy gives ``(lo, hi)`` for the input; the kernel offset ``o`` moves every window by
    ``o`` elements toward the end, keeping the number of windows: ``(lo - o, hi + o)``. A
    negative entry means the windows start inside the input: that many elements are cropped.
    """
    strides, offset = self.strides, self.offset
    if strides is None or offset is None:  # both set by _normalize
      raise self._fail("strides and offset are unset; build the node through its constructor.")
    pads = resolve_padding(self.padding, spatial, self.window, strides, self.dilation_)
    crop, final = [], []
    for (lo, hi), o in zip(pads, offset):
      lo, hi = lo - o, hi + o
      crop.append((max(-lo, 0), max(-hi, 0)))
      final.append((max(lo, 0), max(hi, 0)))
    return tuple(crop), tuple(final)

  def _crop(self, x: jax.Array, spec: Spec) -> tuple[jax.Array, tuple]:
    crop, pads = self.geometry(spec.shape[:-1])
    if any(c != (0, 0) for c in crop):
      n = self.nspatial
      start = [0] * x.ndim
      limit = list(x.shape)
      for i, (a, b) in enumerate(crop):
        ax = x.ndim - 1 - n + i
        start[ax], limit[ax] = a, x.shape[ax] - b
      x = lax.slice(x, start, limit)
    return x, pads

  def _uncrop(self, dx: jax.Array, spec: Spec) -> jax.Array:
    crop, _ = self.geometry(spec.shape[:-1])
    if all(c == (0, 0) for c in crop):
      return dx
    n = self.nspatial
    cfg = [(0, 0, 0)] * dx.ndim
    for i, (a, b) in enumerate(crop):
      cfg[dx.ndim - 1 - n + i] = (a, b, 0)
    return lax.pad(dx, jnp.zeros((), dx.dtype), cfg)

  def check_inputs(self, in_specs):
    (x,) = in_specs
    if len(x.shape) != self.nspatial + 1:
      raise self._fail(
          f"input {self.inputs[0]!r} must be (*spatial, C) with {self.nspatial} spatial dims "
          f"(window {self.window}); got shape {x.shape}.")
    crop, _ = self.geometry(x.shape[:-1])
    for i, (L, (a, b)) in enumerate(zip(x.shape, crop)):
      if a + b >= L:
        raise self._fail(f"offset {self.offset} crops all of spatial dim {i} (size {L}).")

  def _kw(self, pads) -> dict[str, Any]:
    kw = dict(window_shape=self.window, strides=self.strides, padding=pads)
    if self.dilation_ != (1,) * self.nspatial:
      kw["dilation"] = self.dilation_
    return kw

  def infer(self, in_specs):
    self.check_inputs(in_specs)
    (x,) = in_specs
    crop, pads = self.geometry(x.shape[:-1])
    cropped = tuple(L - a - b for L, (a, b) in zip(x.shape[:-1], crop)) + x.shape[-1:]
    try:  # the core checks the window against the padded input, naming the argument
      jaxpool.make_geometry(cropped, **self._kw(pads))
    except (TypeError, ValueError) as e:
      raise self._fail(f"{e} (padding policy {self.padding!r}, offset {self.offset})") from None
    return super().infer(in_specs)

  def describe(self):
    pad = self.padding if isinstance(self.padding, str) else f"pad {self.padding}"
    s = (f"{type(self).__name__} {'x'.join(map(str, self.window))}/"
         f"{'x'.join(map(str, self.strides))} {pad}")
    if any(self.offset):
      s += f" offset {self.offset}"
    if self.dilation_ != (1,) * self.nspatial:
      s += f" dilation {self.dilation_}"
    return s


def taps_from_indices(indices: jax.Array, geom) -> jax.Array:
  """jaxpool's flat argmax indices -> the core's window tap offsets (``-1`` stays ``-1``).

  The inverse of the core's ``flat_indices``: for each spatial dim the input position is
  ``o * s - lo + t * d``, so ``t = (pos - (o * s - lo)) // d``; taps are row-major in the window.
  """
  ndim, n = indices.ndim, geom.nspatial
  tap = jnp.zeros(indices.shape, jnp.int32)
  inner_plane = 1
  for dim in reversed(range(n)):
    pos = (indices // inner_plane) % geom.in_spatial[dim]
    shape = geom.full_dims(ndim, [geom.out_spatial[dim] if i == dim else 1 for i in range(n)], 1)
    start = (np.arange(geom.out_spatial[dim], dtype=np.int32) * geom.strides[dim]
             - geom.padding[dim][0]).reshape(shape)
    t = (pos - start) // geom.dilation[dim]
    tap = tap + t * int(np.prod(geom.window[dim + 1:], dtype=np.int64))
    inner_plane *= geom.in_spatial[dim]
  return jnp.where(indices < 0, -1, tap).astype(taps_dtype(geom.num_taps))


@dataclass(frozen=True)
class MaxPool(_Pool):
  """Max pooling (MPS's ``MPSCNNPoolingMaxNode``) through :func:`jaxpool.max_pool`.

  Attributes:
    source: the input node, ``(*spatial, C)`` per example.
    window: ``k`` per spatial dim (MPS's ``kernelWidth``/``kernelHeight``).
    strides: per spatial dim; default ``window`` (MPS's ``init(source:filterSize:)``).
    padding: ``"VALID"``, ``"SAME"``, ``"FULL"`` or explicit ``(lo, hi)`` pairs.
    offset: MPS's kernel offset per spatial dim: windows move ``o`` elements toward the end
      (``docs/graph.md`` gives the exact mapping to ``(lo, hi)``).

  The gradient state is the argmax (:func:`jaxpool.max_pool_with_indices`); the gradient node
  sends each window's cotangent there with the core's deterministic scatter (the same bits as
  ``jax.grad``).
  """

  keeps_state: ClassVar[bool] = True
  state_doc: ClassVar[str] = "argmax indices"

  def forward(self, params, xs, in_specs):
    x, pads = self._crop(xs[0], in_specs[0])
    return jaxpool.max_pool(x, **self._kw(pads))

  def forward_with_state(self, params, xs, in_specs):
    x, pads = self._crop(xs[0], in_specs[0])
    return jaxpool.max_pool_with_indices(x, **self._kw(pads))

  def backward(self, xs, state, dy, in_specs, wrt):
    if not wrt[0]:
      return (None,), None
    x, pads = self._crop(xs[0], in_specs[0])
    dy = jnp.asarray(dy).astype(x.dtype)
    kw = self._kw(pads)
    geom = jaxpool.make_geometry(x.shape, kw["window_shape"], kw["strides"], kw["padding"],
                                 kw.get("dilation"))
    if state.shape != dy.shape:
      raise self._fail(f"gradient state of shape {state.shape} does not match the source "
                       f"gradient {dy.shape}.")
    tap = taps_from_indices(state, geom)
    _, vjp = jax.vjp(lambda t: xla.gather_at_taps(t, tap, geom), jnp.zeros_like(x))
    return (self._uncrop(vjp(dy)[0], in_specs[0]),), None


@dataclass(frozen=True)
class DilatedMaxPool(MaxPool):
  """Dilated max pooling (MPS's ``MPSCNNDilatedPoolingMaxNode``): :class:`MaxPool` plus
  ``dilation`` (MPS's ``dilationRateX``/``dilationRateY``), default 2 per spatial dim."""

  dilation: tuple[int, ...] | None = field(default=None, kw_only=True)

  def _normalize(self):
    n = len(self.window)
    if self.dilation is None:
      self._set("dilation", (2,) * n)
    super()._normalize()


@dataclass(frozen=True)
class AvgPool(_Pool):
  """Average pooling (MPS's ``MPSCNNPoolingAverageNode``) through :func:`jaxpool.avg_pool`.

  Attributes: as :class:`MaxPool`, plus ``count_include_pad`` (PyTorch's rule: divide by the
  taps inside the padded input, or only by the real ones). Its gradient needs no state, only the
  source image's shape (:func:`jaxpool.avg_pool_grad`).
  """

  count_include_pad: bool = field(default=False, kw_only=True)

  def _normalize(self):
    super()._normalize()
    self._set("count_include_pad", _check_bool(self, "count_include_pad",
                                               self.count_include_pad))

  def forward(self, params, xs, in_specs):
    x, pads = self._crop(xs[0], in_specs[0])
    return jaxpool.avg_pool(x, **self._kw(pads), count_include_pad=self.count_include_pad)

  def backward(self, xs, state, dy, in_specs, wrt):
    if not wrt[0]:
      return (None,), None
    x, pads = self._crop(xs[0], in_specs[0])
    dx = jaxpool.avg_pool_grad(jnp.asarray(dy).astype(x.dtype), x.shape, **self._kw(pads),
                               count_include_pad=self.count_include_pad)
    return (self._uncrop(dx, in_specs[0]),), None


@dataclass(frozen=True)
class L2Pool(_Pool):
  """L2-norm pooling (MPS's ``MPSCNNPoolingL2NormNode``) through :func:`jaxpool.l2_pool`.

  Attributes: as :class:`MaxPool`. The gradient state is the forward's output ``y`` (the window
  norms): ``dx = x * sum over windows of dy / y``, zero where ``y == 0``.
  """

  keeps_state: ClassVar[bool] = True
  state_doc: ClassVar[str] = "window norms"

  def forward(self, params, xs, in_specs):
    x, pads = self._crop(xs[0], in_specs[0])
    return jaxpool.l2_pool(x, **self._kw(pads))

  def forward_with_state(self, params, xs, in_specs):
    y = self.forward(params, xs, in_specs)
    return y, y

  def backward(self, xs, state, dy, in_specs, wrt):
    if not wrt[0]:
      return (None,), None
    x, pads = self._crop(xs[0], in_specs[0])
    kw = self._kw(pads)
    acc = xla.accumulator_dtype(x.dtype)
    xa, y = x.astype(acc), state.astype(acc)
    positive = y > 0
    denom = jnp.where(positive, y, 1)

    def lin(t):  # the tangent map of l2_pool, with y taken from the state; avg_pool with
      # divisor 1 is the window sum, so its transpose is the core's (the same bits as jax.grad)
      s = jaxpool.avg_pool(xa * t.astype(acc), **kw, divisor_override=1)
      return jnp.where(positive, s / denom, 0)

    _, vjp = jax.vjp(lin, jnp.zeros_like(x))
    dx = vjp(jnp.asarray(dy).astype(acc))[0]
    return (self._uncrop(dx.astype(x.dtype), in_specs[0]),), None


# ----------------------------------------------------------------------------- the rest


def _leaky_relu(x):
  return jax.nn.leaky_relu(x, 0.01)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu, "sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh, "gelu": jax.nn.gelu,
    "silu": jax.nn.silu, "softplus": jax.nn.softplus, "elu": jax.nn.elu,
    "leaky_relu": _leaky_relu, "identity": lambda x: x,
}


@dataclass(frozen=True)
class Activation(Node):
  """An elementwise activation (MPS's neuron nodes), by name: one of :data:`ACTIVATIONS`."""

  source: Ref = _input()
  _: KW_ONLY
  fn: str = "relu"

  def _normalize(self):
    if not isinstance(self.fn, str):
      raise self._fail(f"fn must be one of {tuple(ACTIVATIONS)}; got {self.fn!r}.", TypeError)
    if self.fn not in ACTIVATIONS:
      raise self._fail(f"fn must be one of {tuple(ACTIVATIONS)}; got {self.fn!r}.")

  def forward(self, params, xs, in_specs):
    return ACTIVATIONS[self.fn](xs[0])

  def describe(self):
    return f"Activation {self.fn}"


def ReLU(name: str, source: Ref) -> Activation:  # noqa: N802 (reads as a node class)
  """``Activation(name, source, fn="relu")``."""
  return Activation(name, source, fn="relu")


@dataclass(frozen=True)
class Flatten(Node):
  """Flattens the per-example dims: ``(*batch, *shape) -> (*batch, prod(shape))``."""

  source: Ref = _input()

  def forward(self, params, xs, in_specs):
    (x,), (spec,) = xs, in_specs
    return x.reshape((*_batch_shape(x, spec), math.prod(spec.shape)))


@dataclass(frozen=True)
class Add(Node):
  """Elementwise sum of two nodes of the same shape (MPS's ``MPSNNAdditionNode``)."""

  left: Ref = _input()
  right: Ref = _input()
  _input_fields: ClassVar[tuple[str, ...]] = ("left", "right")

  def check_inputs(self, in_specs):
    a, b = in_specs
    if a.shape != b.shape:
      raise self._fail(f"inputs {self.inputs[0]!r} {a.shape} and {self.inputs[1]!r} {b.shape} "
                       "must have the same shape.")

  def forward(self, params, xs, in_specs):
    return xs[0] + xs[1]


@dataclass(frozen=True)
class SoftmaxCrossEntropy(Node):
  """Softmax cross-entropy loss against integer labels, averaged over the batch dims.

  ``logits``: ``(K,)`` per example; ``labels``: an integer input of shape ``()`` per example,
  each a class index in ``[0, K)``. The output is a scalar for any batch:
  ``mean(logsumexp(logits) - logits[label])``.

  A label outside ``[0, K)`` (``-1`` included: it never means the last class) is a
  ``ValueError`` naming the node when the labels are concrete (eager ``apply``/``run``, or
  labels closed over by ``jit``). Traced labels (arguments of ``jit``, ``vmap``) cannot raise:
  there the example's loss is NaN, so the mean loss and the gradients are NaN;
  ``jax.experimental.checkify`` with ``checkify.nan_checks`` or ``jax_debug_nans`` locate it.
  """

  logits: Ref = _input()
  labels: Ref = _input()
  _input_fields: ClassVar[tuple[str, ...]] = ("logits", "labels")

  def check_inputs(self, in_specs):
    lg, lb = in_specs
    if len(lg.shape) != 1:
      raise self._fail(f"logits {self.inputs[0]!r} must be (K,) per example; got {lg.shape}.")
    if lb.shape != () or not jnp.issubdtype(lb.dtype, jnp.integer):
      raise self._fail(f"labels {self.inputs[1]!r} must be integers of shape () per example; "
                       f"got {lb.shape} {lb.dtype}.")

  def check_labels(self, labels: Any, num_classes: int) -> None:
    """Raises ValueError if concrete ``labels`` hold a class outside ``[0, num_classes)``.

    Traced labels (under ``jit``, ``vmap``, ``eval_shape``) cannot be checked here; for them the
    forward makes the loss NaN instead (see :meth:`forward`).
    """
    try:
      values = np.asarray(labels)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
      return
    bad = (values < 0) | (values >= num_classes)
    if bad.any():
      where = tuple(int(i) for i in np.argwhere(bad)[0])
      at = f" at batch index {where}" if where else ""
      raise self._fail(
          f"labels {self.inputs[1]!r} must be class indices in [0, {num_classes}) (logits "
          f"{self.inputs[0]!r} has {num_classes} classes); got {int(values[where])}{at}, "
          f"{int(bad.sum())} out of range in all.")

  def forward(self, params, xs, in_specs):
    logits, labels = xs
    num_classes = in_specs[0].shape[-1]
    self.check_labels(labels, num_classes)
    logp = jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)))
    valid = (labels >= 0) & (labels < num_classes)
    safe = jnp.where(valid, labels, 0).astype(jnp.int32)
    nll = -jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
    # A traced label out of range (no error is possible under jit): that example's loss is NaN,
    # so the mean is NaN, and so are the gradients (a product, where jnp.where would pass a zero
    # gradient and hide it). -1 never wraps to the last class.
    nll = nll * jnp.where(valid, 1, jnp.nan).astype(nll.dtype)
    return jnp.mean(nll)

  def describe(self):
    return "SoftmaxCrossEntropy (mean)"


FORWARD_NODES = (Input, Conv, Dense, MaxPool, DilatedMaxPool, AvgPool, L2Pool, Activation,
                 Flatten, Add, SoftmaxCrossEntropy)
