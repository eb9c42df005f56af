"""``jaxpool.optimize``: run an unmodified JAX function with jaxpool's pooling.

The returned function traces ``fn`` to a jaxpr (once per tree structure, static leaves and
abstract values of its arguments), plans the rewrites, and evaluates the jaxpr with a small
interpreter that binds every equation as JAX would, except the pooling it recognises
(docs/optimize.md lists it). The package, read top down:

* :mod:`.wrapper`: :func:`optimize` and :class:`Optimized` (the signature cache);
* :mod:`.planner`: walks a jaxpr, :data:`~.planner.PATTERNS` (each pooling primitive's
  recogniser) and the place where an offered site is accepted or left to XLA;
* :mod:`.patterns` (max pools, their gradient and JVP, the ReLU fold) and :mod:`.window_sums`
  (average pools, the transpose of a window sum): the recognisers;
* :mod:`.dataflow`, :mod:`.layout`: what the recognisers read (producers, readers, known
  values; which dims are pooled);
* :mod:`.interpreter`: the evaluator on ``jax.extend`` and
  :data:`~.interpreter.HIGHER_ORDER`, the higher-order primitives it enters, by primitive object;
* :mod:`.report`: :class:`OptimizeReport` and :class:`Finding`;
* :mod:`._jax_private`: the only JAX internals used (what ``jax.extend`` lacks), each with why.
"""

from jaxpool._src.optimize.report import Finding as Finding
from jaxpool._src.optimize.report import OptimizeReport as OptimizeReport
from jaxpool._src.optimize.wrapper import Optimized as Optimized
from jaxpool._src.optimize.wrapper import optimize as optimize
