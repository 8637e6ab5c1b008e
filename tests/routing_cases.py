"""Shared helpers of the routing tests (pure: no torch)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from dynatrain_megatron.vps import Layout, ModelSpec, analytic_layout, logical_tensor_map

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "models"


def spec(name: str) -> ModelSpec:
    """`tiny-gpt`, `tiny-moe`, with modifiers: `+tied`, `+ln` (LayerNorm + biases),
    `+bf16`, `+shared` (MoE shared experts), `+gmm` (grouped experts)."""
    base, *mods = name.split("+")
    s = ModelSpec.from_yaml(CONFIGS / f"{base}.yaml")
    for m in mods:
        s = {"tied": lambda x: x.replace(untie_embeddings_and_output_weights=False),
             "bf16": lambda x: x.replace(params_dtype="bf16"),
             "ln": lambda x: x.replace(normalization="LayerNorm", add_bias_linear=True),
             "shared": lambda x: x.replace(moe_shared_expert_intermediate_size=64),
             "gmm": lambda x: x.replace(moe_grouped_gemm=True)}[m](s)
    return s


def lay(text: str, world: int) -> Layout:
    return Layout.parse(text, world)


def held_masks(spec_, layout, devices, kinds, bucket=None):
    """{(device, key, kind): bool mask of the logical tensor} of what each device holds."""
    al = analytic_layout(spec_, layout, bucket)
    tmap = logical_tensor_map(spec_)
    out = {}
    for v, d in enumerate(devices):
        for f in al.fragments(v, kinds):
            m = out.get((d, f.key, f.kind))
            if m is None:
                m = out[(d, f.key, f.kind)] = np.zeros(tmap[f.key].shape, bool)
            m[f.box.slices()] = True
    return out


def brute_lower_bound(spec_, src, src_devices, dst, dst_devices, kinds, bucket=None) -> int:
    """Bytes whose destination device does not already hold them, element by element."""
    from dynatrain_megatron.vps.naming import DTYPE_BYTES
    isz = {"param": DTYPE_BYTES[spec_.params_dtype], "main_param": 4, "exp_avg": 4,
           "exp_avg_sq": 4}
    bs, bd = bucket if isinstance(bucket, tuple) else (bucket, bucket)
    have = held_masks(spec_, src, src_devices, kinds, bs)
    need = held_masks(spec_, dst, dst_devices, kinds, bd)
    tot = 0
    for (d, key, kind), m in need.items():
        h = have.get((d, key, kind))
        tot += int((m & ~h).sum() if h is not None else m.sum()) * isz[kind]
    return tot


def element_cover(pieces, spec_):
    """{(src, dst, key, kind): int array counting how often each element is carried}."""
    tmap = logical_tensor_map(spec_)
    out = {}
    for p in pieces:
        k = (p.src_device, p.dst_device, p.key, p.kind)
        a = out.get(k)
        if a is None:
            a = out[k] = np.zeros(tmap[p.key].shape, np.int64)
        a[p.box.slices()] += 1
    return out
