"""One process of the two-process check in tests/sharding/test_multiprocess.py.

Usage: ``python tests/sharding/multiprocess_worker.py PROCESS_ID PORT OUT_DIR``. Two such processes
join one JAX job on localhost (``jax.distributed``, CPU collectives through gloo, 2 CPU devices
each) and run the gradient of a 3x3/s2/p1 max pool with the Pallas kernels (interpret mode) on a
batch split over the job's 4 devices, under an Auto and an Explicit mesh. Each process saves the
blocks of the gradient it holds (``OUT_DIR/process{ID}.npz``: per mesh kind, each block's first
batch row and its values) and prints one JSON line per mesh kind with what else the test checks:
whether the kernels ran, the output's sharding and the collectives in the compiled program.
"""

from __future__ import annotations

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpool
from jaxpool._src.pallas.sharding.partition import kernel_p

SHAPE = (8, 9, 10, 4)  # (batch, H, W, C): 2 examples a device


def tie_rich() -> np.ndarray:
  """Small integers (many ties, so a wrong tie-break would show), the same in every process."""
  return np.random.default_rng(7).integers(-4, 5, SHAPE).astype(np.float32)


def loss(v):
  return jnp.sum(jaxpool.max_pool(v, (3, 3), (2, 2), 1, implementation="pallas") ** 2)


def main(process_id: int, port: str, out_dir: str) -> None:
  # (Set before anything starts JAX's CPU backend.)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_num_cpu_devices", 2)
  jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2,
                             process_id=process_id, initialization_timeout=120)
  assert jax.process_count() == 2 and len(jax.devices()) == 4, jax.devices()
  x = tie_rich()
  blocks = {}
  for kind in (AxisType.Auto, AxisType.Explicit):
    mesh = jax.make_mesh((4,), ("data",), axis_types=(kind,))
    sharding = NamedSharding(mesh, P("data"))
    xs = jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
    step = jax.jit(jax.grad(loss))
    with jax.set_mesh(mesh):
      # (Auto: jaxpool's kernel primitive; Explicit: its pallas_call under shard_map)
      text = str(jax.make_jaxpr(step)(xs))
      kernels = kernel_p.name in text or "pallas_call" in text
      compiled = step.lower(xs).compile()
      out = compiled(xs)
    comm = sorted(set(re.findall(r" (all-gather|all-to-all|all-reduce|collective-permute|"
                                 r"reduce-scatter)(?:-start)?\(", compiled.as_text())))
    for shard in out.addressable_shards:
      start = shard.index[0].start or 0
      blocks[f"{kind.name}/{start}"] = np.asarray(shard.data)
    print(json.dumps(dict(kind=kind.name, kernels=kernels, spec=str(out.sharding.spec),
                          sharded_like_input=out.sharding.is_equivalent_to(sharding, out.ndim),
                          collectives=comm)), flush=True)
  np.savez(f"{out_dir}/process{process_id}.npz", **blocks)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
