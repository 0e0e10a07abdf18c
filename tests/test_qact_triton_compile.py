"""Every Triton kernel of QACT compiled ahead of time for a Hopper GPU (sm_90, the lent machines' H100 /
H200) by Triton's own compiler and ptxas -- no GPU needed -- and the PTX of the stages whose values
must equal the eager code's bit for bit checked for what Triton's interpreter cannot show: an
approximate float32 division or square root (Triton's float32 ``/`` is ``div.full.f32`` on NVIDIA)
or a fused multiply-add. Skipped without triton."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")


def _ptx_of_every_stage() -> dict:
    """Each stage's kernel, in each variant the dispatch launches, compiled ahead of time for a Hopper
    GPU (sm_90, the lent machines' H100 / H200) by Triton's own compiler and ptxas, without a GPU:
    ``{name: ptx}``."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from shiftguard.functional._qact_triton import context, draws, kde, output, quantiles

    target = GPUTarget("cuda", 90, 32)
    out = {}

    def build(name, fn, signature, constexprs, fp_fusion=True):
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        out[name] = triton_compile(src, target=target, options={"enable_fp_fusion": fp_fusion}).asm["ptx"]

    for dt in ("fp32", "fp64"):
        build(
            f"context {dt}",
            context._grounded_context_kernel,
            {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}", "total": "i64", "C": "i32", "L": "i32", "M": "i32"}
            | {"c_bits": "i64", "BLOCK": "constexpr"},
            {"BLOCK": 1024},
        )
        build(
            f"quantiles {dt}",
            quantiles._grounded_quantiles_kernel,
            {"ctx_ptr": f"*{dt}", "nneg_ptr": "*i64", "q_ptr": f"*{dt}", "xmin_ptr": f"*{dt}", "xmax_ptr": f"*{dt}"}
            | {"K": "i32", "n_tau": "i32", "STEPS": "i32", "c_bits": "i64", "BLOCK_T": "constexpr"},
            {"BLOCK_T": 128},
            fp_fusion=False,
        )
        for from_seed in (True, False):
            for silverman in (True, False):
                ints = {k: "i32" for k in ("lo25", "hi25", "lo75", "hi75", "K", "S", "STEPS")}
                bits = {k: "i64" for k in ("frac25", "frac75", "c_iqr", "c_floor", "c_scale", "c_pow")}
                ptrs = {"ctx_ptr": f"*{dt}", "nneg_ptr": "*i64", "seed_ptr": "*i64", "u_ptr": "*fp64"}
                ptrs |= {"out_ptr": f"*{dt}", "bw_ptr": f"*{dt}"}
                consts = {"FROM_SEED": from_seed, "SILVERMAN": silverman, "BLOCK_S": 1024}
                build(
                    f"draws {dt} seed={from_seed} silverman={silverman}",
                    draws._draws_kernel,
                    ptrs | ints | bits | {k: "constexpr" for k in consts},
                    consts,
                    fp_fusion=False,
                )
        ptrs = {k: f"*{dt}" for k in ("s_ptr", "h_ptr", "xmin_ptr", "xmax_ptr", "lo_ptr", "delta_ptr")}
        build(
            f"kde {dt}",
            kde._kde_grid_kernel,
            ptrs
            | {"n_ptr": "*i64", "grid_ptr": f"*{dt}", "S": "i32", "G": "i32", "truncate": "fp32", "per_h": "i32"}
            | {"max_points": "i32", "scale": "i64", "BLOCK_G": "constexpr", "BLOCK_S": "constexpr"},
            {"BLOCK_G": 64, "BLOCK_S": 64},
            fp_fusion=False,
        )
        for density in (True, False):
            ptrs = {k: f"*{dt}" for k in ("x_ptr", "q_ptr", "out_ptr", "grid_ptr", "lo_ptr", "delta_ptr", "dens_ptr")}
            build(
                f"levels {dt} density={density}",
                output._levels_kernel,
                ptrs
                | {
                    "n_ptr": "*i64",
                    "finite_ptr": "*i8",
                    "total": "i64",
                    "C": "i32",
                    "L": "i32",
                    "n_tau": "i32",
                    "G": "i32",
                }
                | {"LOG_T": "constexpr", "DENSITY": "constexpr", "BLOCK": "constexpr"},
                {"LOG_T": 7, "DENSITY": density, "BLOCK": 256},
            )
    return out


def test_every_stage_compiles_for_a_gpu_and_divides_as_torch_does(tmp_path, monkeypatch):
    """The interpreter runs the kernels' Python, not what a GPU runs: here Triton compiles each one
    for sm_90 (no GPU needed), and the PTX of the stages whose values must equal the eager code's
    bit for bit rounds as torch does -- no approximate float32 division or square root (Triton's
    float32 ``/`` is ``div.full.f32`` on NVIDIA) and no fused multiply-add."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # (not the user's ~/.triton)
    ptx = _ptx_of_every_stage()
    assert len(ptx) == 2 * (1 + 1 + 4 + 1 + 2)
    exact = [
        name for name in ptx if name.startswith(("context", "quantiles", "draws")) or name.endswith("density=False")
    ]
    for name in exact:
        approximate = re.findall(r"\b(?:div\.full\.f32|div\.approx\S*|sqrt\.approx\S*|rcp\.approx\S*)", ptx[name])
        assert not approximate, (name, sorted(set(approximate)))
        if not name.startswith("levels"):
            assert not re.findall(r"\bfma\.", ptx[name]), name
    assert any("div.rn.f32" in ptx[name] for name in exact)
