"""The base of every node: :class:`Node`, its input fields, and the checks nodes share.

A node is an op, its static config and the names of its input nodes (``inputs``). It keeps the
input node objects it was built from (``refs``, not compared, not hashed) only so that
:class:`~jaxpool.graph.Graph` can find every node from the outputs; an input may also be given by
name, which is resolved when the graph is built. Nodes never hold arrays: parameters live in a
separate pytree keyed by node name.

Every array a node sees is ``(*batch, *shape)`` where ``shape`` is the per-example shape the graph
infers at build time (images are channels-last, ``(*spatial, C)``); the batch dims are whatever the
caller passes (none under ``vmap``, as MPS's ``encodeBatch``).

Every node module imports this one and none imports a node module back. The gradient module
(``gradients.py``) registers its classes here (:func:`register_gradient_class`), so that
``node.gradient_filter()`` finds them without importing it. Window, stride, dilation and padding
arguments are checked by the core's rules (``jaxpool._src.checks`` and ``jaxpool._src.windows``),
with errors naming the node.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxpool._src import checks, windows

Ref = Union["Node", str]
Spec = jax.ShapeDtypeStruct
Params = dict[str, jax.Array]
T = TypeVar("T")
N = TypeVar("N", bound="Node")

PADDING_POLICIES = ("VALID", "SAME", "FULL")
POOL_PADDING_POLICIES = (*PADDING_POLICIES, "SAME_LOWER")  # the pooling nodes' (as the core's)
BOOL_HINT = " (True or False)"  # the graph's messages say what a bool is


def input_field(compare: bool = False, **kw: Any) -> Any:
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
  accepts_state: ClassVar[bool] = False  # whether its gradient node takes one it does not need
  state_doc: ClassVar[str] = ""        # what the gradient state carries
  gradient_kind: ClassVar[str] = "Gradient"  # the class of its gradient node (gradients.py)
  state_kind: ClassVar[str] = "GradientState"  # the class of its gradient-state node
  # Training mode (Graph.apply(..., training=True)); see forward_mode:
  has_model_state: ClassVar[bool] = False  # keeps a model state (BatchNorm's running statistics)
  uses_key: ClassVar[bool] = False         # draws random numbers in training mode (Dropout)

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"a node name must be a non-empty str; got {self.name!r}.")
    names, refs = [], []
    for f in self._input_fields:
      for ref in as_refs(getattr(self, f)):
        names.append(ref_name(self.name, f, ref))
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

  def _check(self, checker: Callable[..., T], *args: Any, **kw: Any) -> T:
    """Calls one of the core's argument checkers (``jaxpool._src.windows``); its TypeError or
    ValueError is raised again naming this node."""
    try:
      return checker(*args, **kw)
    except (TypeError, ValueError) as e:
      raise self._fail(str(e), type(e)) from None

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

  # -- training mode -------------------------------------------------------------------------

  @property
  def has_modes(self) -> bool:
    """Whether training and inference differ for this node (it runs through forward_mode)."""
    return self.has_model_state or self.uses_key

  def init_model_state(self, in_specs: tuple[Spec, ...]) -> Params | None:
    """The node's model state before training (BatchNorm: running mean 0, variance 1)."""
    return None

  def forward_mode(self, params: Params | None, xs: tuple[jax.Array, ...],
                   in_specs: tuple[Spec, ...], *, state: Params | None, key: jax.Array | None,
                   training: bool) -> tuple[jax.Array, Params | None, Any]:
    """The forward pass of a node whose training and inference modes differ (:attr:`has_modes`).

    Args:
      state: the node's model state (:attr:`has_model_state`), else None.
      key: the caller's PRNG key in training mode (:attr:`uses_key`), else None; the node folds
        in its own stable value, so every node draws its own numbers.
      training: the mode.

    Returns:
      ``(y, new_state, gradient_state)``: the output, the updated model state (the same in
      inference) and what the gradient needs (None in inference: the gradient state of such a
      node exists only in training mode).
    """
    raise NotImplementedError(type(self).__name__)

  # -- MPS's gradient API ----------------------------------------------------------------------

  def gradient_state(self, name: str | None = None):
    """The gradient-state node that carries what this node's forward keeps for its gradient."""
    return gradient_class(self.state_kind)(name or f"{self.name}.state", self)

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
    if state is None and self.keeps_state:
      state = self.gradient_state()
    cls = gradient_class(self.gradient_kind)
    return cls(name or f"{self.name}.grad", self, source_gradient, self.refs_or_names(), state,
               wrt=None if wrt is None else check_bools(self, "wrt", wrt))

  def refs_or_names(self) -> tuple[Ref, ...]:
    """The inputs as node objects where known, else as names."""
    by_name = {r.name: r for r in self.refs}
    return tuple(by_name.get(n, n) for n in self.inputs)

  def describe(self) -> str:
    """A short description of the op for summaries and pictures."""
    return type(self).__name__


# Gradient-state and gradient-node classes by name, filled by gradients.py (which imports this
# module; this module never imports it back).
_GRADIENT_CLASSES: dict[str, type[Any]] = {}


def register_gradient_class(cls: type[N]) -> type[N]:
  """Class decorator: makes ``cls`` the class a forward node's ``gradient_kind`` names."""
  _GRADIENT_CLASSES[cls.__name__] = cls
  return cls


def gradient_class(kind: str) -> type[Any]:
  """The registered gradient class called ``kind``: ``"GradientState"``, ``"Gradient"``..."""
  try:
    return _GRADIENT_CLASSES[kind]
  except KeyError:
    raise LookupError(f"no gradient class {kind!r} is registered (it is defined in "
                      "jaxpool._src.graph.gradients, which jaxpool.graph imports).") from None


def as_refs(value: Any) -> tuple[Any, ...]:
  if value is None:
    return ()
  if isinstance(value, (Node, str)):
    return (value,)
  if isinstance(value, (tuple, list)):
    return tuple(value)
  return (value,)


def ref_name(owner: str, field_name: str, ref: Any) -> str:
  if isinstance(ref, Node):
    return ref.name
  if isinstance(ref, str) and ref:
    return ref
  raise TypeError(f"node {owner!r}: {field_name} must be a node or a node name; got {ref!r}.")


def batch_shape(x: jax.Array, spec: Spec) -> tuple[int, ...]:
  return tuple(x.shape[:x.ndim - len(spec.shape)])


def check_bool(node: Node, name: str, value: Any) -> bool:
  """A bool (``checks.check_bool``), the error naming ``node``."""
  return node._check(checks.check_bool, name, value, hint=BOOL_HINT)


def check_choice(node: Node, name: str, value: Any, allowed: Sequence[Any]) -> Any:
  """One of the names ``allowed`` (``checks.check_name``), the error naming ``node``."""
  return node._check(checks.check_name, name, value, allowed)


def check_bools(node: Node, name: str, value: Any) -> tuple[bool, ...]:
  """A sequence of bools (``wrt``), as a tuple; anything else is a TypeError naming ``node``."""
  try:
    items = tuple(value)
  except TypeError:
    raise node._fail(f"{name} must be a sequence of bools; got {value!r}.", TypeError) from None
  if not all(isinstance(w, (bool, np.bool_)) for w in items):
    raise node._fail(f"{name} must be a sequence of bools; got {value!r}.", TypeError)
  return tuple(bool(w) for w in items)


def check_float_dtype(node: Node, name: str, value: Any) -> np.dtype:
  dt = check_dtype(node, name, value)
  if not jnp.issubdtype(dt, jnp.floating):
    raise node._fail(f"{name} must be a float dtype; got {value!r}.", TypeError)
  return dt


def check_real(node: Node, name: str, value: Any, low: float, high: float | None, *,
               open_low: bool = False, open_high: bool = False) -> float:
  """A real number (not a bool) in ``[low, high]`` (``(`` / ``)`` where open; ``high`` None: no
  bound), as a Python float; a TypeError or ValueError naming ``node`` otherwise."""
  interval = (f"{'(' if open_low else '['}{low:g}, "
              f"{'inf)' if high is None else f'{high:g}' + (')' if open_high else ']')}")
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                   np.floating)):
    raise node._fail(f"{name} must be a number in {interval}; got {value!r}.", TypeError)
  v = float(value)
  if not (v > low if open_low else v >= low) or (
      high is not None and not (v < high if open_high else v <= high)):
    raise node._fail(f"{name} must be a number in {interval}; got {value!r}.")
  return v


def check_dtype(node: Node, name: str, value: Any) -> np.dtype:
  if value is None:  # np.dtype(None) is float64: never what was meant
    raise node._fail(f"{name} must be a dtype; got None.", TypeError)
  try:
    return np.dtype(value)
  except TypeError:
    raise node._fail(f"{name} must be a dtype; got {value!r}.", TypeError) from None


def check_window(node: Node, window: Any) -> tuple[int, ...]:
  """A windowed node's ``window``: one int >= 1 per spatial dim, at least one dim."""
  n = node._check(windows.spatial_rank, window, "window")
  return node._check(checks.int_tuple, "window", window, n)


def check_image(node: Node, spec: Spec, window: tuple[Any, ...],
                data_format: str = "channels_last", what: str = "window") -> None:
  """A windowed node's input: ``(*spatial, C)`` per example (``(C, *spatial)`` channels-first),
  one spatial dim per entry of ``window`` (or of the argument ``what`` names)."""
  if len(spec.shape) != len(window) + 1:
    layout = "(*spatial, C)" if data_format == "channels_last" else "(C, *spatial)"
    raise node._fail(
        f"input {node.inputs[0]!r} must be {layout} with {len(window)} spatial dims "
        f"({what} {window}); got shape {spec.shape}.")


def check_data_format(node: Node, value: Any) -> str:
  """``"channels_last"`` (``(*spatial, C)`` per example) or ``"channels_first"``
  (``(C, *spatial)``), the core's ``data_format`` (``jaxpool._src.windows.DATA_FORMATS``)."""
  return check_choice(node, "data_format", value, windows.DATA_FORMATS)


def spatial_shape(shape: Sequence[int], data_format: str) -> tuple[int, ...]:
  """The spatial dims of a per-example image shape."""
  return tuple(shape[:-1] if data_format == "channels_last" else shape[1:])


def channel_axis(data_format: str) -> int:
  """The channel axis of an image, counted from the end (per-example and batched alike) for
  channels-last, from the start of the per-example dims for channels-first."""
  return -1 if data_format == "channels_last" else 0


def spatial_axes(x: jax.Array, spec: Spec, data_format: str) -> tuple[int, ...]:
  """The axes of ``x`` (``(*batch, *spec.shape)``) that are spatial."""
  return windows.spatial_axes(x.ndim, len(spec.shape) - 1, data_format == "channels_last")


def array_axis(x: jax.Array, spec: Spec, axis: int) -> int:
  """A per-example ``axis`` (negative from the end) as an axis of ``x`` (``(*batch, *shape)``)."""
  return axis if axis < 0 else x.ndim - len(spec.shape) + axis


def flatten_example(x: jax.Array, spec: Spec, data_format: str) -> jax.Array:
  """``(*batch, *spec.shape) -> (*batch, prod(spec.shape))`` in channels-last order: a
  channels-first image ``(C, *spatial)`` is flattened as ``(*spatial, C)``, so that the result
  equals the channels-last graph's."""
  batch = batch_shape(x, spec)
  if data_format == "channels_first" and len(spec.shape) > 1:
    x = jnp.moveaxis(x, len(batch), -1)
  return x.reshape((*batch, math.prod(spec.shape)))


def check_axis(node: Node, name: str, axis: Any) -> int:
  """A per-example axis: an int (NumPy ints taken, bools not), negative from the end."""
  if not checks.is_int(axis):
    raise node._fail(f"{name} must be an int; got {axis!r}.", TypeError)
  return int(axis)


def axis_in_range(node: Node, name: str, axis: int, spec: Spec, input_name: str) -> int:
  """``axis`` as a non-negative per-example axis of ``spec``; ValueError if out of range."""
  rank = len(spec.shape)
  if not -rank <= axis < rank:
    raise node._fail(f"{name} {axis} is out of range for input {input_name!r} of per-example "
                     f"shape {spec.shape}.")
  return axis % rank


def check_padding(node: Node, padding: Any, n: int, policies: tuple[str, ...] = PADDING_POLICIES
                  ) -> str | tuple[tuple[int, int], ...]:
  """A padding policy (one of ``policies``) as given, or ``n`` explicit ``(lo, hi)`` pairs."""
  if isinstance(padding, str) and padding in policies:
    return padding
  if isinstance(padding, str) or not isinstance(padding, Iterable):
    raise node._fail(f"padding must be one of {policies} or (lo, hi) pairs; got "
                     f"{padding!r}.", ValueError if isinstance(padding, str) else TypeError)
  return node._check(windows.padding_pairs, padding, n)


def resolve_padding(policy: str | tuple[tuple[int, int], ...], in_spatial: Sequence[int],
                    window: Sequence[int], strides: Sequence[int], dilation: Sequence[int]
                    ) -> tuple[tuple[int, int], ...]:
  """A padding policy as ``(lo, hi)`` pairs, one per spatial dim.

  ``"VALID"``: none. ``"SAME"``: ``ceil(L / s)`` outputs, the odd element of padding at the end
  (ONNX SAME_UPPER, as :func:`jaxpool.max_pool`); ``"SAME_LOWER"`` (pooling nodes) puts it at
  the start. ``"FULL"``: ``e - 1`` on both sides (``e`` the
  effective window ``d * (k - 1) + 1``): every window that touches a real element. The core
  computes them (``jaxpool._src.windows.resolve_string_padding``).

  Example:
    >>> resolve_padding("SAME", (7,), (3,), (2,), (1,))
    ((1, 1),)
  """
  if isinstance(policy, str):
    if policy not in POOL_PADDING_POLICIES:
      raise ValueError(f"padding must be one of {POOL_PADDING_POLICIES} or (lo, hi) pairs; got "
                       f"{policy!r}.")
    return windows.resolve_string_padding(policy, in_spatial, window, strides, dilation)
  return tuple(policy)


@dataclass(frozen=True)
class Initializer:
  """A ``jax.nn.initializers`` factory by name, with its arguments, called when used.

  ``Initializer("he_normal")(key, shape, dtype)`` is
  ``jax.nn.initializers.he_normal()(key, shape, dtype)``. Unlike the closure the factory
  returns, it pickles (by name and arguments) and compares equal to an equal config, so nodes
  that hold one do too. Nodes take any initializer function as well.

  Example:
    >>> init = Initializer("variance_scaling", (1.0, "fan_in", "normal"))
    >>> init(jax.random.key(0), (3, 2), jnp.float32).shape
    (3, 2)
  """

  name: str
  args: tuple[Any, ...] = ()
  kwargs: tuple[tuple[str, Any], ...] = ()

  def __post_init__(self):
    if not callable(getattr(jax.nn.initializers, self.name, None)):
      raise ValueError(f"Initializer: jax.nn.initializers has no factory {self.name!r}.")
    object.__setattr__(self, "args", tuple(self.args))
    object.__setattr__(self, "kwargs", tuple(sorted(dict(self.kwargs).items())))

  def __call__(self, key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32
               ) -> jax.Array:
    factory = getattr(jax.nn.initializers, self.name)
    return factory(*self.args, **dict(self.kwargs))(key, shape, dtype)
