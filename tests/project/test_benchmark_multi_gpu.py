"""benchmarks/multi_gpu.py in short runs on forced CPU devices (``--cpu-devices``: toy sizes, the
kernels in interpret mode; a test of the script, not a measurement). In the slow tier
(``make test-all``):

* on 2 devices, the VGG step with its parameters and optimizer state split over the devices
  (``fsdp``, and ``fsdp_bf16`` with bfloat16 all-gathers and reduce-scatters) gives one
  device's loss, and the compiled program's collectives are counted, the combined
  (tuple-valued) ones too; the ``no_pool`` variant runs the model without its pools;
* on 8 devices, the weak scaling of the max pool (``--parts weak``): a row for every device
  count and split, jaxpool's splits bit-equal to one device, each split's halo exchange timed
  alone with the pieces the split program sends, and the fields the docs cite;
* on 2 devices, the U-Net and ResNet-50 parts: a row for each count and variant, and the
  JSON file keeps the rows of an earlier run of another part.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("optax")
pytest.importorskip("flax")

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "multi_gpu.py"


def run_script(*args: str, timeout: int = 900) -> None:
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
  # (the script forces the device count; make test's level: the XLA path bit-reproducible)
  env["XLA_FLAGS"] = " ".join(flags + ["--xla_backend_optimization_level=0"])
  proc = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True,
                        text=True, timeout=timeout)
  assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"


@pytest.mark.slow  # (about 1 min: three compiled VGG steps in each of three variants)
def test_vgg_fsdp_mode(tmp_path):
  out = tmp_path / "mg.json"
  run_script("--cpu-devices", "2", "--parts", "vgg", "--counts", "2", "--modes",
             "one GPU,fsdp,fsdp_bf16", "--variants", "plain,optimize,no_pool", "--steps", "0",
             "--reps", "1", "--out", str(out))
  rows = {(r["variant"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
  assert set(rows) == {(v, m) for v in ("plain", "optimize", "no_pool")
                       for m in ("one GPU", "fsdp", "fsdp_bf16")}
  for variant in ("plain", "optimize"):
    row = rows[variant, "fsdp"]
    assert "error" not in row, row
    assert row["devices"] == 2 and row["loss_vs_one_gpu"] < 1e-5, row
    # The step's update: each updated parameter's norm as one device's, to the bfloat16
    # model's rounding (a bias starts at zero, so after one step its norm is the norm of its
    # bfloat16 gradient: 1.5e-2 apart on the Auto mesh too). An update left out moves a
    # bias's norm by 1 (relative).
    assert row["params_vs_one_gpu"] < 5e-2, row
    assert row["update_vs_one_gpu"] < 0.3, row
    counts = row["collectives"]
    # The parameters that are split are gathered whole for the model.
    assert counts.get("all-gather", 0) >= 1, counts
    # The gradients are summed over the devices in one combined all-reduce (XLA:CPU sums the
    # split kernel's whole, then each device keeps its part), whose result is a tuple of more
    # than five arrays (the HLO text then holds "/*index=5*/" inside the result's type); its
    # largest array is the split dense kernel's gradient, 1024 x 128.
    assert counts.get("all-reduce max elems", 0) == 1024 * 128, counts

  for variant in ("plain", "optimize", "no_pool"):
    row = rows[variant, "fsdp_bf16"]
    assert "error" not in row, row
    # The forward is one device's (the model casts its parameters to bfloat16 itself). The
    # gradients are summed in bfloat16: each array's update (new minus initial values) is one
    # device's to the bfloat16 model's rounding (up to 5e-2 relative on some small array, on
    # the Auto mesh too); a gradient summed but not averaged over the 2 devices, or counted
    # twice, moves an array's update by 1 or more (relative).
    assert row["loss_vs_one_gpu"] < 1e-5 and row["update_vs_one_gpu"] < 0.3, row
    counts = row["collectives"]
    # The split parameters are gathered and their gradients reduce-scattered (the gather's
    # transpose): the split dense kernel's part (512 x 128) is the largest piece a device keeps.
    assert counts.get("all-gather", 0) >= 1, counts
    assert counts.get("reduce-scatter max elems", 0) == 512 * 128, counts
  # Without its pools the model computes something else (a strided slice for each pool).
  assert rows["no_pool", "one GPU"]["loss"] != rows["plain", "one GPU"]["loss"]


@pytest.mark.slow  # (about 2.5 min on 2 cores: some 30 programs, the kernels interpreted)
def test_weak_scaling_rows(tmp_path):
  out = tmp_path / "weak.json"
  run_script("--cpu-devices", "8", "--parts", "weak", "--ops", "max_pool", "--dtypes",
             "float32", "--chain", "1", "--reps", "1", "--out", str(out), timeout=1500)
  data = json.loads(out.read_text())
  # What the docs cite with the numbers: the flags, the tuning mode, the device, each run.
  assert {"device", "devices", "jax", "xla_flags", "jaxpool_tune", "runs"} <= set(data)
  assert data["devices"] == 8 and "weak" in data["runs"]
  rows = data["rows"]
  assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r]
  layouts = {("depth", 1, (1,)), ("depth", 2, (2,)), ("depth", 4, (4,)), ("depth", 8, (8,)),
             ("depth x height", 4, (2, 2)), ("depth x height", 8, (4, 2))}
  pools = {(r["impl"], r["split"], r["devices"], tuple(r["mesh"])): r
           for r in rows if r["kind"] == "pool"}
  assert set(pools) == {(impl, *lay) for impl in ("jaxpool", "reduce_window")
                        for lay in layouts}
  halos = {(r["split"], r["devices"]): r for r in rows if r["kind"] == "halo"}
  assert set(halos) == {(s, n) for s, n, _ in layouts if n > 1}
  for (impl, split, n, mesh), r in pools.items():
    # Weak scaling: every device holds one block (1x4x8x8x4), the whole grows with the mesh.
    assert r["global_shape"] == [1, 4 * mesh[0], 8 * (mesh[1] if len(mesh) > 1 else 1), 8, 4]
    assert r["chain_ms"] > 0 and r["ms"] > 0 and r["efficiency"] > 0, r
    if n == 1:
      assert r["equal_to_one_device"] is None and r["efficiency"] == 1.0, r
      continue
    # The split's forward output and gradient, bit for bit those of one device.
    assert r["equal_to_one_device"] is True, r
    assert r["out_spec"] == ("P(None, 'd')" if split == "depth" else "P(None, 'd', 'h')"), r
    if impl == "jaxpool":
      counts = r["collectives"]
      # The kernels' split moves halos only: collective-permutes, never a gather.
      assert counts.get("collective-permute", 0) >= 1, counts
      assert not {"all-gather", "all-to-all", "reduce-scatter"} & set(counts), counts
      halo = halos[split, n]
      # The floor sends what the split program sends: as many pieces, the largest as large
      # (a depth halo of the max pool: one input row and one cotangent row with its taps).
      assert halo["permutes"] == counts["collective-permute"], (halo, counts)
      assert halo["collectives"]["collective-permute max elems"] == \
          counts["collective-permute max elems"], (halo, counts)
      assert halo["halo_bytes"] > 0 and halo["chain_ms"] > 0, halo
      assert r["vs_reduce_window"] > 0 and r["halo_share"] > 0, r
      if split == "depth":
        assert sorted(halo["pieces"]) == ["f32[1, 1, 4, 4, 4]", "f32[1, 1, 8, 8, 4]",
                                          "s8[1, 1, 4, 4, 4]"], halo


@pytest.mark.slow  # (about 4 min on 2 shared cores: ResNet-50 compiles and steps on a CPU)
def test_unet_and_resnet50_rows(tmp_path):
  out = tmp_path / "mg.json"
  # An earlier run's row of another part stays in the file.
  out.write_text(json.dumps(dict(rows=[dict(part="pool", dtype="float32", op="max_pool",
                                            impl="jaxpool", split="batch", devices=2, ms=1.0)])))
  run_script("--cpu-devices", "2", "--parts", "unet,resnet50", "--variants", "optimize",
             "--reps", "1", "--steps", "0", "--out", str(out))
  rows = json.loads(out.read_text())["rows"]
  assert [r["part"] for r in rows].count("pool") == 1
  unet = {(r["variant"], r["devices"]): r for r in rows if r["part"] == "unet"}
  # (the U-Net runs plain Flax and optimize whatever --variants says)
  assert set(unet) == {(v, n) for v in ("plain", "optimize") for n in (1, 2)}
  for r in unet.values():
    assert "error" not in r and r["volume"] == [32, 16, 16], r
    assert r["speedup"] > 0 and r["vs_plain"] > 0, r
    # The same step on one volume: one device's loss, split or not, optimized or not.
    assert abs(r["loss"] - unet["plain", 1]["loss"]) < 1e-3, r
  resnet = {(r["variant"], r["mode"], r["devices"], r["global_batch"]): r for r in rows
            if r["part"] == "resnet50"}
  # Each count's modes: one device with its own 2 images (the baseline); the 4 images of 2
  # devices on one device, and split over the 2.
  assert set(resnet) == {("optimize", *k)
                         for k in (("one GPU", 1, 2), ("one GPU", 1, 4), ("auto", 2, 4))}
  for (_, mode, _, batch), r in resnet.items():
    assert "error" not in r and r["ms"] > 0 and r["loop_ms"] is None, r
    if batch == 2 or mode == "auto":  # (data-parallel efficiency: against the baseline)
      assert r["efficiency"] > 0, r
    if mode == "auto":
      # Data parallel on 2 devices: each its 2 images; the same batch of 4 on one device
      # gives the same loss (BatchNorm's statistics span the whole batch).
      assert r["global_batch"] == 4 and r["loss_vs_one_gpu"] < 1e-3, r
      assert r["speedup_vs_one_gpu"] > 0, r
