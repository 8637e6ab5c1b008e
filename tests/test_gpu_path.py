"""The GPU path checked on the CPU: Transformer Engine names, the optimizer step of fused
Adams, the preparation thread's device and stream, NCCL-safe transport (first batch,
polled deadlines), the memory check of A and B together, and `scripts/gpu_check.py`."""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from dynatrain_megatron.adapters.live import (LiveState, ensure_optimizer_state,
                                              read_optimizer_step, write_optimizer_step)
from dynatrain_megatron.vps.analytic import analytic_layout
from dynatrain_megatron.vps.layout import Layout
from dynatrain_megatron.vps.model_spec import ModelSpec
from dynatrain_megatron.vps.naming import (TE_FUSED_NORMS, analytic_param_name,
                                           chunk_param_specs)

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY_GPT = ModelSpec.from_yaml(ROOT / "configs/models/tiny-gpt.yaml")
TINY_MOE = ModelSpec.from_yaml(ROOT / "configs/models/tiny-moe.yaml")


# ----------------------------------------------------------------- Transformer Engine names
def _te_fused_modules_from_megatron() -> dict[str, str]:
    """From megatron-core's own source (TE cannot be imported here): which submodule of a
    dense layer of `get_gpt_layer_with_transformer_engine_spec` is TE's fused
    LayerNormLinear, and which separate norm is then an IdentityOp."""
    import importlib.util

    # the file itself, without importing megatron-core (slow) or TE (absent)
    roots = importlib.util.find_spec("megatron").submodule_search_locations
    src = next(pathlib.Path(r) / "core/models/gpt/gpt_layer_specs.py" for r in roots
               if (pathlib.Path(r) / "core/models/gpt/gpt_layer_specs.py").is_file())
    tree = ast.parse(src.read_text())
    funcs = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}

    def calls(fn, callee):
        return [c for c in ast.walk(fn) if isinstance(c, ast.Call)
                and getattr(c.func, "id", getattr(c.func, "attr", None)) == callee]

    fused = "column_parallel_layer_norm_linear"
    layer = funcs["get_gpt_layer_with_transformer_engine_spec"]
    # the non-MLA layer: SelfAttentionSubmodules(linear_qkv=backend.<fused>(), ...)
    attn = calls(layer, "SelfAttentionSubmodules")
    assert len(attn) == 1
    qkv = {k.arg: k.value for k in attn[0].keywords}["linear_qkv"]
    assert qkv.func.attr == fused
    subs = [c for c in calls(layer, "TransformerLayerSubmodules")
            if any(k.arg == "self_attention" and "SelfAttention" in ast.dump(k.value)
                   and "MLASelfAttention" not in ast.dump(k.value) for k in c.keywords)]
    assert len(subs) == 1
    kw = {k.arg: k.value for k in subs[0].keywords}
    out = {}
    if "input_layernorm" not in kw:  # TransformerLayerSubmodules' default: IdentityOp
        out["input_layernorm"] = "self_attention.linear_qkv"
    pre = kw["pre_mlp_layernorm"]  # `backend.layer_norm() if num_experts else IdentityOp`
    assert isinstance(pre, ast.IfExp) and getattr(pre.orelse, "id", None) == "IdentityOp"
    mlp = funcs["get_mlp_module_spec_for_backend"]
    fc1 = [a for a in ast.walk(mlp) if isinstance(a, ast.Assign)
           and getattr(a.targets[0], "id", None) == "linear_fc1"
           and isinstance(a.value, ast.Call) and getattr(a.value.func, "attr", None) == fused]
    if fc1:
        out["pre_mlp_layernorm"] = "mlp.linear_fc1"
    return out


def test_te_fused_norm_map_matches_megatron_te_spec():
    assert TE_FUSED_NORMS == _te_fused_modules_from_megatron()


@pytest.mark.parametrize("spec", [TINY_GPT, TINY_GPT.replace(normalization="LayerNorm"), TINY_MOE],
                         ids=["gpt-rms", "gpt-layernorm", "moe"])
def test_te_param_specs_name_te_params_with_analytic_keys(spec):
    lay = Layout.parse("tp2pp2", 4) if not spec.is_moe else Layout.parse("tp1pp2ep2", 4)
    te = spec.replace(transformer_engine=True)
    for pp in range(lay.pp):
        local = chunk_param_specs(spec, lay, pp, 0)
        fused = chunk_param_specs(te, lay, pp, 0)
        # the same tensors with the same keys and shapes, under TE's names
        assert sorted((p.key, p.local_shape) for p in local) == \
            sorted((p.key, p.local_shape) for p in fused)
        assert {analytic_param_name(p.local_name): p.key for p in fused} == \
            {p.local_name: p.key for p in local}
        names = [p.local_name for p in fused]
        assert not any(".input_layernorm." in n for n in names)
        assert any(n.endswith("self_attention.linear_qkv.layer_norm_weight") for n in names)
        assert any(n.endswith("pre_mlp_layernorm.weight") for n in names) == spec.is_moe
        assert any(n.endswith("layer_norm_bias") for n in names) == (spec.normalization == "LayerNorm")
        # TE registers the norm's parameters before the layer's weight (named_parameters order)
        for i, n in enumerate(names):
            if n.endswith("linear_qkv.layer_norm_weight") or n.endswith("linear_fc1.layer_norm_weight"):
                rest = names[i + 1:i + 3]
                host = n.rsplit(".", 1)[0]
                assert host + ".weight" in rest
    # the analytic layout holds the same bytes (the order changes only bucket boundaries)
    assert analytic_layout(te, lay).bytes_per_rank()["param"].sum() == \
        analytic_layout(spec, lay).bytes_per_rank()["param"].sum()


def test_live_key_of_te_fused_norm_is_the_analytic_key():
    # stacked layers: megatron-core's sharded key has no layer index (it is the prepended
    # axis); the local name has the chunk's own index
    key = LiveState._canonical_key
    assert key("decoder.layers.self_attention.linear_qkv.layer_norm_weight",
               "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", (5,)) == \
        "decoder.layers.5.input_layernorm.weight"
    assert key("decoder.layers.mlp.linear_fc1.layer_norm_bias",
               "decoder.layers.1.mlp.linear_fc1.layer_norm_bias", (3,)) == \
        "decoder.layers.3.pre_mlp_layernorm.bias"
    assert analytic_param_name("decoder.layers.2.mlp.linear_fc1.weight") == \
        "decoder.layers.2.mlp.linear_fc1.weight"
    assert analytic_param_name("output_layer.layer_norm_weight") == "output_layer.layer_norm_weight"


# ----------------------------------------------------------------- optimizer step
class FusedAdam(torch.optim.Optimizer):
    """TE's / apex's FusedAdam as far as the step goes: `group['step']`, made at step 1."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self):
        for g in self.param_groups:
            g["step"] = g.get("step", 0) + 1
            for p in g["params"]:
                st = self.state[p]
                st.setdefault("exp_avg", torch.zeros_like(p))
                st.setdefault("exp_avg_sq", torch.zeros_like(p))


class _DistOpt:  # what optimizers_of unwraps: `.optimizer` is the torch optimizer
    def __init__(self, inner):
        self.optimizer = inner


def _chain(*inners):
    class Chained:
        chained_optimizers = [_DistOpt(i) for i in inners]
    return Chained()


@pytest.mark.parametrize("style", ["torch", "fused"])
def test_optimizer_step_read_and_written_where_the_optimizer_keeps_it(style):
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    if style == "torch":
        inner = torch.optim.Adam(params, lr=0.1)
        for p in params:
            p.grad = torch.ones_like(p)
    else:
        inner = FusedAdam(params)
    fresh_params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    fresh = torch.optim.Adam(fresh_params) if style == "torch" else FusedAdam(fresh_params)
    a, b = _chain(inner), _chain(fresh)
    assert read_optimizer_step(a) is None
    for _ in range(3):
        inner.step()
    assert read_optimizer_step(a) == 3.0
    ensure_optimizer_state(b)  # what binding B does before the transfer
    has_param_step = any("step" in st for st in fresh.state.values())
    assert has_param_step == (style == "torch")
    write_optimizer_step(b, 3.0)
    assert read_optimizer_step(b) == 3.0
    if style == "torch":
        steps = [fresh.state[p]["step"] for p in fresh_params]
        assert all(float(s) == 3.0 for s in steps)
        assert steps[0] is not steps[1]  # one tensor per parameter, never shared
    else:
        assert all(g["step"] == 3 for g in fresh.param_groups)
        fresh.step()
        assert read_optimizer_step(b) == 4.0  # bias correction continues, not from 1


def test_a_loaded_torch_adams_stale_group_step_is_not_its_count():
    # a torch Adam loaded from a Megatron-LM checkpoint of iteration 2 carries
    # group['step'] = 2, which it never advances: after 4 more steps the count is 6
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    inner = torch.optim.Adam(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    inner.step()
    inner.step()
    sd = inner.state_dict()
    for g in sd["param_groups"]:
        g["step"] = 2  # as in Megatron-LM's checkpoint
    loaded = torch.optim.Adam(params, lr=0.1)
    loaded.load_state_dict(sd)
    for _ in range(4):
        loaded.step()
    assert all(g["step"] == 2 for g in loaded.param_groups)  # stale
    assert read_optimizer_step(_chain(loaded)) == 6.0
    write_optimizer_step(_chain(loaded), 7.0)
    assert all(g["step"] == 7 for g in loaded.param_groups)
    assert all(float(loaded.state[p]["step"]) == 7.0 for p in params)


# ----------------------------------------------------------------- the preparation thread
class _FakeCuda:
    """torch.cuda as far as the preparation thread uses it, recording per thread."""

    def __init__(self):
        import threading

        self.set_in: list = []  # (thread name, device)
        self.streams: list = []
        self.entered: list = []  # thread names that entered their stream
        self.synced: list = []
        self._threading = threading

    def set_device(self, device):
        self.set_in.append((self._threading.current_thread().name, device))

    def Stream(self, device=None):  # noqa: N802 - torch's name
        fake = self

        class S:
            def synchronize(self):
                fake.synced.append(self)
        s = S()
        self.streams.append((s, device))
        return s

    def stream(self, s):
        import contextlib
        fake = self

        @contextlib.contextmanager
        def ctx():
            fake.entered.append((fake._threading.current_thread().name, s))
            yield
        return ctx()


def test_preparation_thread_sets_the_rank_device_and_its_own_stream(monkeypatch):
    from dynatrain_megatron.elastic import communicators, device_manager

    fake = _FakeCuda()
    monkeypatch.setattr(communicators.torch, "cuda", fake)
    monkeypatch.setattr(device_manager, "build_groups", lambda layout, placement: "groups")
    dev = torch.device("cuda", 3)  # what the training thread had set (LOCAL_RANK 3)
    dm = device_manager.DeviceManager(device=dev)
    seen = []
    dm.prepare(Layout.parse("tp1", 1), lambda layout: None, background=True,
               then=lambda g: seen.append(g) or "prepared")
    dm._thread.join(30)
    assert seen == ["groups"]
    assert fake.set_in == [("dynatrain-prepare", dev)]  # in the thread, the rank's device
    (stream, sdev), = fake.streams
    assert sdev == dev and fake.entered == [("dynatrain-prepare", stream)]
    assert fake.synced == [stream]  # B complete before the training thread reads it
    assert dm._prepared == "prepared"


def test_device_manager_records_the_creating_threads_device(monkeypatch):
    from dynatrain_megatron.elastic import communicators, device_manager

    class C:
        @staticmethod
        def is_available():
            return True

        @staticmethod
        def current_device():
            return 5
    monkeypatch.setattr(communicators.torch, "cuda", C)
    assert device_manager.DeviceManager().device == torch.device("cuda", 5)
    monkeypatch.setattr(C, "is_available", staticmethod(lambda: False))
    assert device_manager.DeviceManager().device is None  # CPU: nothing to set


# ----------------------------------------------------------------- NCCL-safe transport
def test_every_rank_posts_the_transfer_groups_first_batch_even_empty(monkeypatch):
    """NCCL's first batch_isend_irecv on a group needs every rank of it: a rank with
    nothing to exchange still takes part (the warm-up), once per group."""
    from dynatrain_megatron.transition import transport as tp

    calls = []
    monkeypatch.setattr(tp.dist, "all_reduce", lambda t, group=None, **k: calls.append(("warm", group)))
    monkeypatch.setattr(tp.dist, "batch_isend_irecv", lambda ops: calls.append(("batch", len(ops))) or [])
    monkeypatch.setattr(tp, "collective_device", lambda group=None: torch.device("cpu"))
    monkeypatch.setattr(tp.dist, "P2POp", lambda *a, **k: a)
    groups = [object.__new__(type("G", (), {})) for _ in range(2)]  # two ranks' handles
    tp._WARM.clear()
    idle = tp.TorchP2PTransport(groups[0], nccl=True)
    busy = tp.TorchP2PTransport(groups[1], nccl=True)
    idle.start({}, {}).wait()  # rank with nothing to send or receive in round 0
    busy.start({1: [torch.zeros(2)]}, {}).wait()
    assert calls == [("warm", groups[0]), ("warm", groups[1]), ("batch", 1)]
    calls.clear()
    idle.start({}, {}).wait()
    busy.start({1: [torch.zeros(2)]}, {1: [torch.zeros(2)]}).wait()
    assert calls == [("batch", 2)]  # warmed once; later rounds are plain batches
    gloo = tp.TorchP2PTransport(object.__new__(type("H", (), {})), nccl=False)
    gloo.start({}, {}).wait()
    assert calls == [("batch", 2)]  # gloo: unchanged (creates communicators eagerly)


class _Work:
    def __init__(self, done_after: float):
        import time
        self.t = time.monotonic() + done_after
        self.waited = False

    def is_completed(self):
        import time
        return time.monotonic() >= self.t

    def wait(self, timeout=None):
        self.waited = True
        return True


def test_polled_deadline_aborts_the_group_and_raises_timeout():
    from dynatrain_megatron.transition.transport import Pending

    aborted = []
    w = _Work(done_after=3600)
    with pytest.raises(TimeoutError, match="aborted"):
        Pending([w], polled=True, on_timeout=lambda: aborted.append(1)).wait(timeout=0.05)
    assert aborted == [1] and not w.waited  # never a blocking wait on a peer that is gone
    ok = [_Work(0.01), _Work(0.0)]
    Pending(ok, polled=True, on_timeout=lambda: aborted.append(2)).wait(timeout=5)
    assert all(x.waited for x in ok) and aborted == [1]


def test_batched_checksums_equal_one_by_one():
    from dynatrain_megatron.transition.checksum import _device_sum, checksum, checksums

    g = torch.Generator().manual_seed(3)
    buf = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=g)
    msgs = [buf[o:o + n] for o, n in ((0, 0), (1, 7), (3, 801), (8, 4000), (5, 13))]
    assert checksums(msgs) == [checksum(m) for m in msgs]
    # the device formula (no host sync), run here on CPU tensors, is the same sum
    assert [int(_device_sum(m)) & 0xFFFFFFFFFFFFFFFF for m in msgs] == [checksum(m) for m in msgs]


# ----------------------------------------------------------------- memory of A and B together
def test_switch_memory_arithmetic_and_decision():
    from dynatrain_megatron.vps.errors import LayoutError
    from dynatrain_megatron.vps.memory import estimate_state_memory, switch_memory_plan

    spec = ModelSpec.from_yaml(ROOT / "configs/models/llama3-70b.yaml").replace(params_dtype="bf16")
    a, b = Layout.parse("tp8pp4dp4", 128), Layout.parse("tp4pp4dp8", 128)
    dev = tuple(range(128))
    GiB = 1 << 30

    def plan(mem, act=20 * GiB, reserve=4 * GiB):
        return switch_memory_plan(spec, a, dev, b, dev, device_memory_bytes=mem,
                                  activation_bytes=act, reserve_bytes=reserve)

    p = plan(80 * GiB)
    # the per-device sum is exactly A's state + grads (estimate_state_memory) + activations
    # + B's state + grads + reserve, on the same device for both layouts (same placement)
    ea, eb = estimate_state_memory(spec, a), estimate_state_memory(spec, b)
    (m0, bg, d0), (m1, ip, d1) = p.need_bytes[:2]
    assert (m0, m1) == ("background", "in_pause")
    assert bg == ip + 20 * GiB
    assert bg <= ea.max_bytes + eb.max_bytes + 24 * GiB
    assert p.a_state + p.a_grads + p.activations + p.b_state + p.reserve == bg
    assert abs(p.a_state + p.a_grads - 19.04 * GiB) < 0.01 * GiB  # the figures
    assert abs(p.b_state - 31.72 * GiB) < 0.01 * GiB
    assert p.mode == "background" and "in the background" in p.describe()
    # between the two needs: B is built at the boundary, after A's activations are freed
    q = plan((bg + ip) // 2)
    assert q.mode == "in_pause" and "degraded" in q.describe()
    assert plan(bg).mode == "background" and plan(bg - 1).mode == "in_pause"
    # then without A's gradient buffers (freed at the boundary)
    (m2, rg, _), = p.need_bytes[2:]
    assert m2 == "release_a_grads" and rg == ip - p.a_grads
    assert plan(ip - 1).mode == "release_a_grads" and "gradient buffers" in plan(rg).describe()
    r = plan(rg - 1)
    assert r.mode is None and not r.fits and "do not fit" in r.describe()
    # standby devices of A carry no activations; a scale-in B on fewer devices still counts
    small = switch_memory_plan(spec, a, dev, Layout.parse("tp8pp4dp2", 64), dev[:64],
                               device_memory_bytes=80 * GiB, activation_bytes=0)
    assert small.need_bytes[0][1] == small.need_bytes[1][1]  # B-only devices: no A at all
    with pytest.raises(LayoutError, match="activation_bytes"):
        plan(80 * GiB, act=-1)


# ----------------------------------------------------------------- scripts/gpu_check.py
_WITHOUT_NEW_APIS = """
import runpy, sys
import torch.distributed as dist
_orig = dist.new_group
def new_group(ranks=None, timeout=None, backend=None, pg_options=None):  # torch before 2.6
    return _orig(ranks, timeout=timeout, backend=backend, pg_options=pg_options)
dist.new_group = new_group
dist.ProcessGroup.abort = None
import torch.distributed.config
del dist.config
from dynatrain_megatron.compat import torch_features as tf
assert not tf.ordered_groups() and not tf.eager_groups() and not tf.process_group_abort()
assert tf.use_torchcomms() is False
import dynatrain_megatron.transition.switch, dynatrain_megatron.elastic.groups  # imports fine
sys.argv = [sys.argv[1]] + sys.argv[2:]
sys.exit(runpy.run_path(sys.argv[0], run_name="__main__"))
"""


def test_gpu_check_dry_run_reports_missing_torch_apis_instead_of_failing(tmp_path):
    """`--dry-run` on the CPU under a torch without the newer distributed APIs: the
    preflight says which are missing, every check is listed, and the report is written in
    docs/bench/gpu.md's format to the folder given."""
    import subprocess
    import sys

    script = ROOT / "scripts/gpu_check.py"
    p = subprocess.run([sys.executable, "-c", _WITHOUT_NEW_APIS, str(script), str(tmp_path),
                        "--dry-run"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = {tuple(line.split()[:2]): line.split()[-1] for line in p.stdout.splitlines()
             if line.startswith("preflight")}
    assert lines[("preflight", "new_group(sort_ranks=)")] == "False"
    assert lines[("preflight", "new_group(device_id=)")] == "False"
    assert lines[("preflight", "ProcessGroup.abort")] == "False"
    assert lines[("preflight", "distributed.config.use_torchcomms")] == "False"
    assert lines[("preflight", "model")] == "ok"  # every model config a check reads
    names = [line.split()[1] for line in p.stdout.splitlines() if line.startswith("check ")]
    assert names == ["a_background_prep", "b_memory_plan", "c_background_comms",
                     "d_abort_destroy", "e_executor_geometry", "g_megatron_lm"]
    md = (tmp_path / "gpu.md").read_text()
    assert md.startswith("# GPU check") and "dry run" in md and "| ProcessGroup.abort | False |" in md
    assert all(f"({x})" in md for x in "abcdefg")
    mod = _gpu_check_module()
    for c in mod.CHECKS:  # every check has its worker; the limits fit in 8 minutes
        assert callable(getattr(mod, f"w_{c.name}", None) or getattr(mod, f"run_{c.name}"))
    assert sum(c.limit_s for c in mod.CHECKS) <= 480 and mod.TOTAL_BUDGET_S < 480
    bad = subprocess.run([sys.executable, str(script), str(tmp_path), "--dry-run", "--only",
                          "nope"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "unknown checks" in bad.stderr


def _gpu_check_module():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts/gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules["gpu_check"]
    return mod


def test_gpu_check_makes_its_copied_configs_readable(tmp_path):
    """A tree copied onto the lent machine with a umask of 002 has group-writable model
    configs, which the project refuses to read (so every check would fail): the check's
    bootstrap clears those bits on this user's own files, and leaves links alone."""
    import os

    mod = _gpu_check_module()
    models = tmp_path / "configs/models"
    models.mkdir(parents=True)
    for name, mode in (("a.yaml", 0o664), ("b.yaml", 0o644), ("c.yaml", 0o666)):
        (models / name).write_text("name: x\n")
        os.chmod(models / name, mode)
    (models / "link.yaml").symlink_to(models / "b.yaml")
    fixed, left = mod.tree_configs_writable_by_others(tmp_path)
    assert fixed == ["configs/models/a.yaml", "configs/models/c.yaml"] and left == []
    assert {p.name: p.lstat().st_mode & 0o777 for p in models.iterdir() if not p.is_symlink()} \
        == {"a.yaml": 0o644, "b.yaml": 0o644, "c.yaml": 0o644}
    assert mod.tree_configs_writable_by_others(tmp_path) == ([], [])


def test_gpu_check_takes_from_its_wheels_only_what_the_machine_lacks(tmp_path, monkeypatch):
    """What travels in gpu_wheels/ (make gpu-wheels): a wheel whose modules (read from
    its contents, not its name) are missing is unzipped once into the cache and
    importable; one whose module the machine has (yaml from PyYAML, megatron.core here)
    is left out, so the machine's own is used; one for another Python is skipped; a
    cache folder others can write is refused."""
    import importlib
    import os
    import sys
    import zipfile

    mod = _gpu_check_module()
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(mod, "tree_configs_writable_by_others", lambda root=None: ([], []))
    wheels, cache = tmp_path / "wheels", tmp_path / "cache"
    wheels.mkdir()
    for name, tags, files in (
            ("Dyn_Gpu_Fake", "py3-none-any", ("dyn_gpu_fake/__init__.py", "dyn_gpu_one.py")),
            ("PyYAML", "py3-none-any", ("yaml/__init__.py", "_yaml/__init__.py")),
            ("megatron_core", "py3-none-any", ("megatron/core/__init__.py",)),
            ("dyn_gpu_other", "cp39-cp39-linux_x86_64", ("dyn_gpu_other/__init__.py",))):
        with zipfile.ZipFile(wheels / f"{name}-9.9-{tags}.whl", "w") as z:
            for f in files:
                z.writestr(f, "FROM_WHEEL = True\n")
            z.writestr(f"{name}-9.9.dist-info/METADATA", "")
    assert mod.wheel_modules(wheels / "PyYAML-9.9-py3-none-any.whl") == {"yaml", "_yaml"}
    assert mod.wheel_modules(wheels / "megatron_core-9.9-py3-none-any.whl") == {"megatron.core"}
    added = mod.bootstrap(wheels, cache)
    assert added == [str(mod.ROOT), str(cache / "Dyn_Gpu_Fake-9.9-py3-none-any")]
    try:
        assert importlib.import_module("dyn_gpu_fake").FROM_WHEEL
        assert importlib.import_module("dyn_gpu_one").FROM_WHEEL
    finally:
        sys.modules.pop("dyn_gpu_fake", None)
        sys.modules.pop("dyn_gpu_one", None)
    assert not hasattr(importlib.import_module("yaml"), "FROM_WHEEL")
    assert not (cache / "dyn_gpu_other-9.9-cp39-cp39-linux_x86_64").exists()
    assert mod.bootstrap(wheels, cache) == [str(mod.ROOT)]  # on sys.path already
    marker = cache / "Dyn_Gpu_Fake-9.9-py3-none-any/dyn_gpu_one.py"
    marker.write_text("UNZIPPED_ONCE = True\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != added[1]])
    assert mod.bootstrap(wheels, cache) == added and "ONCE" in marker.read_text()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != added[1]])
    os.chmod(cache, 0o777)
    with pytest.raises(SystemExit, match="only it can write"):
        mod.bootstrap(wheels, cache)
    # make gpu-wheels fetches megatron-core's wheel for the lent machine's Python
    make = (mod.ROOT / "Makefile").read_text()
    assert "--python-version 3.12" in make and "megatron-core==0.16.1" in make


def _gpu_check_workers_on_cpu(names: list) -> dict:
    """gpu_check's workers on the CPU runtime (one gloo rank), with small models where the
    GPU run uses large ones and the device-memory readings faked: what they call in the
    project is what the one GPU run will call, so a change that breaks them fails here."""
    import torch

    from dynatrain_megatron.compat import prepare_runtime

    prepare_runtime()
    mod = _gpu_check_module()
    real = mod._spec
    small = dict(num_layers=4, hidden_size=512, ffn_hidden_size=1024, vocab_size=4000)
    mod._spec = lambda name, **kw: (real(name, **kw).replace(**small) if name == "llama3-70b"
                                    else real("tiny-gpt", **kw))
    GiB = 1 << 30
    torch.cuda.mem_get_info = lambda *a: (50 * GiB, 80 * GiB)  # this child process only
    torch.cuda.memory_stats = lambda *a: {}
    torch.cuda.max_memory_reserved = lambda *a: 0
    return {n: getattr(mod, f"w_{n}")() for n in names}


@pytest.mark.multirank
def test_gpu_check_workers_run_on_the_cpu_with_small_models():
    """The GPU check has one run on a lent machine: its workers' own logic (not the GPU's
    figures) is exercised here. (d) is all CUDA/NCCL and is left to the GPU."""
    from dynatrain_megatron.testing.multiproc import run_on_ranks

    (out,) = run_on_ranks(_gpu_check_workers_on_cpu, 1, ["a_background_prep", "b_memory_plan",
                                                         "c_background_comms",
                                                         "e_executor_geometry"], timeout=600)
    a, b, c, e = (out[k] for k in ("a_background_prep", "b_memory_plan", "c_background_comms",
                                   "e_executor_geometry"))
    # (a) dropout 0.1 with and without B prepared beside A: the same bits
    assert a["ok"] and a["losses_equal"] and a["weights_equal"] and a["prepare_error"] is None, a
    # (b) two A->A switches, each planned and landed
    assert b["ok"] and [r["aborted"] for r in b["switches"]] == [None, None], b
    assert all(r["mode"] == "background" for r in b["switches"])
    # (c) six groups made in the background while the main thread ran collectives
    assert c["ok"] and c["groups"] == 6 and c["main_collectives"] >= 20, c
    # (e) one rank's pieces through the loopback executor, the pause's parts measured
    assert e["ok"] and not e["errors"] and e["pieces"] > 0 and e["bytes"] > e["local_bytes"], e
    assert set(e["pause_breakdown"]) >= {"plan_s", "executor_s", "checksum_s"}


def test_placement_falls_back_to_rank_order_without_ordered_groups(monkeypatch):
    from dynatrain_megatron.compat import torch_features as tf
    from dynatrain_megatron.transition import switch as S

    monkeypatch.setattr(S, "ordered_groups", lambda: False)
    calls = []
    choice = type("C", (), {"chosen": "best", "default": "default"})()
    monkeypatch.setattr(S, "placement_choice", lambda *a: choice)
    monkeypatch.setattr(S, "best_rank_ordered", lambda c, n: calls.append(c) or ["ordered"])
    builder = type("B", (), {"bucket_size": lambda self, l: None})()
    assert S.choose_dst_placement(TINY_GPT, builder, None, None, None, (0, 1)) == "ordered"
    with pytest.raises(RuntimeError, match="sort_ranks"):
        monkeypatch.setattr(tf, "_new_group_params", lambda: frozenset({"ranks", "backend"}))
        tf.new_group([1, 0], keep_order=True)


def test_b_groups_warmed_in_creation_order_members_only(monkeypatch):
    """At the safe point every rank warms the NCCL groups of B it belongs to, in the
    order they were created (the same on every rank), the transfer group last; gloo
    twins and groups this rank is not in are left alone."""
    import types

    from dynatrain_megatron.elastic import communicators as cm

    G = type("G", (), {})
    tp, dp, twin, transfer = G(), G(), G(), G()
    non_member = cm.dist.GroupMember.NON_GROUP_MEMBER
    groups = types.SimpleNamespace(created=[tp, non_member, dp, twin, tp, transfer],
                                   transfer=transfer)
    warmed = []
    monkeypatch.setattr(cm, "is_nccl", lambda group=None: True)
    monkeypatch.setattr(cm.dist, "get_backend", lambda g=None: "gloo" if g is twin else "nccl")
    monkeypatch.setattr(cm, "warm_up", warmed.append)
    cm.warm_up_groups(groups)
    assert warmed == [tp, dp, transfer]
    warmed.clear()
    monkeypatch.setattr(cm, "is_nccl", lambda group=None: False)
    cm.warm_up_groups(groups)  # gloo made them eagerly: nothing to do
    assert warmed == []


@pytest.mark.parametrize("memory_gib,expect", [(80, "background"), (60, "in_pause"),
                                               (50, "release_a_grads"), (40, None)])
def test_hook_prepares_b_as_the_memory_plan_decides(monkeypatch, memory_gib, expect):
    """The hook's reaction to an accepted request with `--dynatrain-device-memory`: B in the
    background, B at the step boundary (degraded, logged), or no switch (request failed)."""
    from dynatrain_megatron.elastic.controller import Decision
    from dynatrain_megatron.loop import hook as H

    monkeypatch.setattr(H.DynatrainHook, "_record_outcome", lambda self, *a, **k: None)
    from dynatrain_megatron.loop import memory_check as MC
    from dynatrain_megatron.mcore.train_config import TrainConfig
    from dynatrain_megatron.vps.placement import Placement

    spec = ModelSpec.from_yaml(ROOT / "configs/models/llama3-70b.yaml").replace(params_dtype="bf16")
    monkeypatch.setattr(MC, "agree_on_max", lambda v: v)  # one process stands for all ranks
    monkeypatch.setattr(H, "choose_dst_placement", lambda spec, b, s, sp, dst, dev, *a: Placement(dev))
    started = []
    monkeypatch.setattr(H, "start_preparation", lambda *a, **k: started.append(a[4]))

    class Ctl:
        done_with: list = []
        last_request = None

        def done(self, d, outcome, reason=""):
            self.done_with.append((outcome, reason))

    GiB = 1 << 30
    hook = H.DynatrainHook(spec, TrainConfig(), Ctl(), memory=MC.SwitchMemoryCheck(
        memory_gib * GiB, activation_reserve_bytes=20 * GiB, reserve_bytes=4 * GiB))
    src = Layout.parse("tp8pp4dp4", 128)
    hook.layout, hook.layout_placement = src, Placement(tuple(range(128)))
    hook._on_decision(Decision("tp4pp4dp8", 128, "signal"), 10)
    if expect == "background":
        assert [str(x) for x in started] == ["tp4pp4dp8"] and hook._sync_target is None
    elif expect in ("in_pause", "release_a_grads"):  # built in the pause
        assert started == [] and str(hook._sync_target[0]) == "tp4pp4dp8"
        assert hook._release_a_grads == (expect == "release_a_grads")
    else:
        assert started == [] and hook._sync_target is None and hook.decision is None
        assert hook.controller.done_with[-1][0] == "failed"
        assert "do not fit" in hook.rejected[-1]


def test_released_a_grads_come_back_when_the_switch_rolls_back(monkeypatch):
    """Degraded mode release_a_grads: A's gradient buffers are freed before B is built in
    the pause and restored (zeroed, megatron's restore_grad_buffers) on a rollback."""
    import types

    from dynatrain_megatron.loop import hook as H

    monkeypatch.setattr(H.DynatrainHook, "_record_outcome", lambda self, *a, **k: None)
    from dynatrain_megatron.mcore.train_config import TrainConfig
    from dynatrain_megatron.vps.placement import Placement

    calls = []

    class Chunk:
        def offload_grad_buffers(self, synchronize, empty_cache):
            calls.append("offload")

        def restore_grad_buffers(self, synchronize):
            calls.append("restore")

    objs = types.SimpleNamespace(model=[Chunk(), Chunk()])
    trainer = types.SimpleNamespace(objs=objs, iteration=7)
    monkeypatch.setattr(H, "build_groups", lambda dst, pl: calls.append("build B") or "groups")
    aborted = types.SimpleNamespace(aborted="switch aborted in transfer: test")
    monkeypatch.setattr(H, "switch_trainer", lambda tr, *a, **k: (tr, aborted))

    class Ctl:
        last_request = None

        def done(self, d, outcome, reason=""):
            calls.append(outcome)

    hook = H.DynatrainHook(TINY_GPT, TrainConfig(), Ctl())
    hook.layout, hook.layout_placement = Layout.parse("tp1", 2), Placement((0, 1))
    hook._sync_target = (Layout.parse("tp2", 2), Placement((0, 1)))
    hook._release_a_grads = True
    import gc

    assert gc.isenabled()
    assert hook._switch(trainer) is trainer
    assert calls == ["offload", "offload", "build B", "restore", "restore", "failed"]
    assert hook._release_a_grads is False  # once: the next switch decides again
    # the switch held automatic collections off; it rolled back, so they run again
    assert gc.isenabled()


# ----------------------------------------------------------------- issue 27, 1. vocab padding
def _pad_plan(model: str, a: str, b: str, world: int, unavailable=()):
    from dynatrain_megatron.configs import load_model
    from dynatrain_megatron.transition.vocab_padding import padding_plan
    from dynatrain_megatron.vps.fragment import KINDS
    from dynatrain_megatron.vps.placement import Placement

    spec = load_model(model)
    la, lb = Layout.parse(a, world), Layout.parse(b, world)
    return padding_plan((analytic_layout(spec, la), Placement.default(world)),
                        (analytic_layout(spec, lb), Placement.default(world)), KINDS,
                        unavailable)


def _max_per_device(plan) -> tuple[int, int]:
    per = plan.elements_per_device()
    return (max((s for s, _ in per.values()), default=0),
            max((r for _, r in per.values()), default=0))


@pytest.mark.parametrize("a,b", [("tp2", "tp4"), ("tp4pp2", "tp2pp2"), ("tp1", "tp2")])
def test_padding_bytes_per_device_do_not_grow_with_the_world(a, b):
    """The same switch at 4, 8 and 1024 ranks (DP grows): the most any device sends or
    receives stays the same; the world-wide gather it replaces grew with the world."""
    worlds = (4, 8, 1024) if "pp2" not in a else (8, 16, 1024)
    got = [_max_per_device(_pad_plan("tiny-gpt", a, b, w)) for w in worlds]
    # never more than at the smallest world (finer optimizer shards send less)
    assert got[0][1] > 0 and all(s <= got[0][0] and r <= got[0][1] for s, r in got), got
    # what the world-wide gather gave every rank: all held padding, growing with the world
    gathered = [sum(h.hi - h.lo for h in _pad_plan("tiny-gpt", a, b, w).held) for w in worlds]
    assert gathered[0] < gathered[1] < gathered[2]
    # every device that needs padding rows gets each element exactly once
    for w in worlds[:2]:
        plan = _pad_plan("tiny-gpt", a, b, w)
        for n in plan.needed:
            covered = sorted((p.lo, p.hi) for p in plan.pieces
                             if (p.key, p.kind, p.dst) == (n.key, n.kind, n.device)
                             and n.lo <= p.lo and p.hi <= n.hi)
            at = n.lo
            for lo, hi in covered:
                assert lo == at
                at = hi
            assert at == n.hi, (n, covered)


def _padding_exchange_case(a: str, b: str, sizes: tuple) -> dict:
    """For each job size n in `sizes`: a job at `a` and one at `b` side by side on the
    world's first n ranks (the others standby; tiny-gpt: 1000 rows, 1024 with padding).
    A's padding rows (weights and optimizer state) are set to a function of their global
    flat index, then `carry_vocab_padding` moves them into B's on a transport that counts
    what this rank really sends and receives."""
    import torch.distributed as dist

    from dynatrain_megatron.mcore.builders import MegatronBuilder
    from dynatrain_megatron.mcore.session import release, start_job
    from dynatrain_megatron.transition.transport import TorchP2PTransport
    from dynatrain_megatron.transition.vocab_padding import (_flat_lo, carry_vocab_padding,
                                                             padding_plan)
    from dynatrain_megatron.vps.fragment import KINDS
    from dynatrain_megatron.vps.placement import Placement
    from rank_cases import switch_train_config

    me = dist.get_rank()
    train = switch_train_config({"micro_batch_size": 1})
    builder = MegatronBuilder(TINY_GPT, train)

    def live(tr):
        return None if tr is None else LiveState(tr.objs.model, tr.objs.optimizer,
                                                 tr.objs.groups.virtual_rank, TINY_GPT.vocab_size)

    def value(g: torch.Tensor, kind: str) -> torch.Tensor:  # exact in fp32
        # fp32 weights: the optimizer's main params are views of the weights themselves
        plane = {"param": 0, "main_param": 0, "exp_avg": 1, "exp_avg_sq": 2}[kind]
        return (g % 4096 + 1 + 10000 * plane).float()

    def one(n: int) -> dict:
        la, lb, placement = Layout.parse(a, n), Layout.parse(b, n), Placement.default(n)
        ja, jb = start_job(TINY_GPT, la, train, placement), start_job(TINY_GPT, lb, train,
                                                                      placement)
        old, new = live(ja), live(jb)
        for f in old.padding_fragments(KINDS) if old else ():
            v = old.view(f.kind, f.chunk, f.local_name, f.local_box)
            lo = _flat_lo(old, f)
            v.copy_(value(torch.arange(lo, lo + v.numel()), f.kind).view(v.shape))
        for f in new.padding_fragments(KINDS) if new else ():  # garbage: all must be written
            new.view(f.kind, f.chunk, f.local_name, f.local_box).fill_(-7)
        plan = padding_plan(
            (analytic_layout(TINY_GPT, la, builder.bucket_size(la)), placement),
            (analytic_layout(TINY_GPT, lb, builder.bucket_size(lb)), placement), KINDS)
        count = dict(sent=0, received=0, peers=set(), exchanges=0)

        class Counting(TorchP2PTransport):
            def start(self, sends, recvs, tag=0):
                count["exchanges"] += 1
                for key, box in (("sent", sends), ("received", recvs)):
                    for peer, ts in box.items():
                        assert peer != me  # local copies never reach the transport
                        count["peers"].add(peer)
                        count[key] += sum(t.numel() * t.element_size() for t in ts)
                return super().start(sends, recvs, tag)

        written, errors = carry_vocab_padding(plan, me, old, new, Counting(), timeout=60)
        cols, rows_a = TINY_GPT.hidden_size, TINY_GPT.padded_vocab_size(la.tp)
        wrong = 0
        for f in new.padding_fragments(KINDS) if new else ():
            v = new.view(f.kind, f.chunk, f.local_name, f.local_box).reshape(-1)
            g = torch.arange(_flat_lo(new, f), _flat_lo(new, f) + v.numel())
            want = torch.where(g < rows_a * cols, value(g, f.kind), torch.zeros(()))
            wrong += int((v.float() != want).sum())
        for tr in (jb, ja):
            if tr is not None:
                release(tr.objs)
        dist.barrier()
        sent, received = plan.elements_per_device().get(me, (0, 0))
        return dict(sent=count["sent"], received=count["received"], peers=len(count["peers"]),
                    exchanges=count["exchanges"], plan_sent=sent * 4, plan_received=received * 4,
                    written=written, errors=errors, wrong=wrong, member=old is not None,
                    world_gather_bytes=sum((h.hi - h.lo) * 4 for h in plan.held))

    return {n: one(n) for n in sizes}


@pytest.mark.multirank
def test_padding_exchange_bytes_per_rank_counted_in_4_and_8_rank_jobs():
    """Issue 27, 1, on real ranks: the same switch (tp2 -> tp1, DP grows with the job) in
    a 4-rank job (4 more ranks standby) and an 8-rank job. What each rank sends and
    receives on the transport is what the plan says, B's padding rows are A's (zero beyond
    them), and the most any rank moves does not grow from 4 to 8 ranks, while what the
    world-wide gather it replaced gave every rank did."""
    from dynatrain_megatron.testing.multiproc import run_on_ranks

    res = run_on_ranks(_padding_exchange_case, 8, "tp2", "tp1", (4, 8), timeout=600)
    got = {n: [r[n] for r in res] for n in (4, 8)}
    for n, rs in got.items():
        assert [r["member"] for r in rs] == [True] * n + [False] * (8 - n)
        for r in rs:
            assert not r["errors"] and r["wrong"] == 0, (n, r)
            assert r["written"] > 0 or not r["member"], (n, r)
            assert (r["sent"], r["received"]) == (r["plan_sent"], r["plan_received"]), (n, r)
            assert r["exchanges"] == (1 if r["sent"] or r["received"] else 0), (n, r)
            assert r["peers"] <= 2, (n, r)
    most = {n: max(max(r["sent"], r["received"]) for r in rs) for n, rs in got.items()}
    assert 0 < most[8] <= most[4], most
    assert got[4][0]["world_gather_bytes"] < got[8][0]["world_gather_bytes"]
    print(f"padding bytes, most per rank: 4 ranks {most[4]}, 8 ranks {most[8]}; "
          f"what a world gather gave every rank: {got[4][0]['world_gather_bytes']}, "
          f"{got[8][0]['world_gather_bytes']}")


def test_padding_plan_skips_dead_holders_and_pads_nothing_without_padding():
    plan = _pad_plan("tiny-gpt", "tp2", "tp2", 8, unavailable=(0, 2))
    assert plan.pieces and not {p.src for p in plan.pieces} & {0, 2}
    assert all(p.src == p.dst for p in _pad_plan("tiny-gpt", "tp2", "tp2", 8).pieces)
    # the llama3-70b vocabulary (128256) is a multiple of 128 * 8: no padding anywhere
    from dynatrain_megatron.configs import load_model

    spec = load_model("llama3-70b")
    if spec.padded_vocab_size(8) == spec.vocab_size:
        assert not _pad_plan("llama3-70b", "tp8pp8", "tp4pp8", 128).pieces


# ----------------------------------------------------------------- issue 27, 2. memory check
class _FakeDevice:
    """A device-memory source with settable readings (peaks since the last reset)."""

    def __new__(cls, **kw):
        from dynatrain_megatron.loop.memory_check import MemoryInfo, PeakWindow

        class Fake(PeakWindow):
            def __init__(self, total, free, allocated, reserved):
                super().__init__()
                self.now = dict(total=total, free=free, allocated=allocated, reserved=reserved)
                self.peaks = [allocated, reserved]
                self.resets = 0

            def use(self, allocated, reserved, free=None):
                """The allocator reaches these figures (peaks follow)."""
                self.now.update(allocated=allocated, reserved=reserved)
                if free is not None:
                    self.now["free"] = free
                self.peaks = [max(self.peaks[0], allocated), max(self.peaks[1], reserved)]

            def _raw(self):
                return MemoryInfo(peak_allocated=self.peaks[0], peak_reserved=self.peaks[1],
                                  **self.now)

            def _reset(self):
                self.resets += 1
                self.peaks = [self.now["allocated"], self.now["reserved"]]

        return Fake(**kw)


def test_memory_check_is_on_with_a_device_and_measures_it():
    import types

    from dynatrain_megatron.loop import memory_check as MC

    GiB = 1 << 30
    args = types.SimpleNamespace(dynatrain_device_memory=None, dynatrain_activation_reserve=0,
                                 dynatrain_memory_reserve=GiB)
    assert MC.from_args(args) is None  # the CPU, nothing configured: off
    dev = _FakeDevice(total=80 * GiB, free=30 * GiB, allocated=40 * GiB, reserved=48 * GiB)
    check = MC.from_args(args, source=dev)
    assert check is not None and check.device_memory_bytes is None  # on, by default
    lb = Layout.parse("tp4pp4dp8", 128)
    total, pool, reserve = check.inputs(lb)
    # total from mem_get_info; A's pool = reserved - allocated (cached blocks B's side
    # stream cannot use); outside torch = total - free - reserved (context, A's NCCL)
    assert total == 80 * GiB and pool == 8 * GiB
    comms = MC.new_communicators(lb)
    from dynatrain_megatron.vps.layout import GROUP_AXES

    assert 2 < comms <= len(GROUP_AXES) + 2
    assert MC.new_communicators(Layout.parse("tp1", 1)) == 1  # one rank: its own group only
    assert reserve == GiB + 2 * GiB + comms * MC.DEFAULT_NCCL_COMM_BYTES


def test_memory_check_on_a_gpu_reads_the_device_and_resets_its_peaks(monkeypatch):
    """No flag given, a CUDA device present: the job's check reads `mem_get_info` and the
    allocator's stats of the rank's device, and every step boundary (and a switch) resets
    the allocator's peaks, so a window never holds more than the last step."""
    import types

    from dynatrain_megatron.loop import memory_check as MC

    GiB = 1 << 30
    calls = []
    stats = {"allocated_bytes.all.current": 20 * GiB, "reserved_bytes.all.current": 24 * GiB,
             "allocated_bytes.all.peak": 31 * GiB, "reserved_bytes.all.peak": 33 * GiB}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda d=None: calls.append(("info", d)) or (50 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda d=None: dict(stats))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda d=None: calls.append(("reset", d)))
    args = types.SimpleNamespace(dynatrain_device_memory=None, dynatrain_activation_reserve=0,
                                 dynatrain_memory_reserve=0)
    check = MC.from_args(args)
    assert check is not None and isinstance(check.source, MC.CudaMemory)
    assert check.source.device == 3
    total, pool, _ = check.inputs(Layout.parse("tp2", 2))
    assert total == 80 * GiB and pool == 13 * GiB  # peak reserved - allocated
    assert ("info", 3) in calls and ("reset", 3) not in calls
    check.step_boundary()
    assert calls[-1] == ("reset", 3)
    stats.update({"allocated_bytes.all.peak": 20 * GiB, "reserved_bytes.all.peak": 24 * GiB})
    check.forget_peaks()  # after a switch: the window starts from what is live now
    assert calls[-1] == ("reset", 3) and check.inputs(Layout.parse("tp2", 2))[1] == 4 * GiB


def test_memory_peaks_are_per_step_and_forgotten_after_a_switch():
    from dynatrain_megatron.loop import memory_check as MC

    GiB = 1 << 30
    dev = _FakeDevice(total=80 * GiB, free=40 * GiB, allocated=30 * GiB, reserved=30 * GiB)
    check = MC.SwitchMemoryCheck(source=dev)
    lb = Layout.parse("tp2", 2)
    dev.use(allocated=50 * GiB, reserved=52 * GiB)  # a step: 20 GiB of activations
    dev.use(allocated=30 * GiB, reserved=52 * GiB)
    check.step_boundary()
    assert check.inputs(lb)[1] == 22 * GiB  # the last step's peak minus what is live
    dev.use(allocated=90 * GiB, reserved=90 * GiB, free=0)  # a switch: A and B together
    dev.use(allocated=35 * GiB, reserved=40 * GiB, free=40 * GiB)  # A released
    check.forget_peaks()
    check.step_boundary()
    assert check.inputs(lb)[1] == 5 * GiB  # never the switch's 90 GiB peak
    dev.use(allocated=55 * GiB, reserved=60 * GiB)
    dev.use(allocated=35 * GiB, reserved=60 * GiB)
    check.step_boundary()
    check.step_boundary()  # two boundaries: the window is the last step only
    assert check.inputs(lb)[1] == 25 * GiB
    with pytest.raises(Exception, match="device memory"):
        MC.SwitchMemoryCheck()  # neither a size nor a device


def test_switch_that_does_not_fit_the_measured_device_is_refused_before_b_exists(monkeypatch):
    """The hook's decision with a measured device (GPU fake): NCCL buffers of B's new
    communicators and memory outside torch make a switch that fits by state alone fail;
    nothing of B is built (no groups, no preparation)."""
    from dynatrain_megatron.elastic.controller import Decision
    from dynatrain_megatron.loop import hook as H

    monkeypatch.setattr(H.DynatrainHook, "_record_outcome", lambda self, *a, **k: None)
    from dynatrain_megatron.loop import memory_check as MC
    from dynatrain_megatron.mcore.train_config import TrainConfig
    from dynatrain_megatron.vps.memory import switch_memory_plan
    from dynatrain_megatron.vps.placement import Placement

    GiB = 1 << 30
    spec = ModelSpec.from_yaml(ROOT / "configs/models/llama3-70b.yaml").replace(params_dtype="bf16")
    src, dst = Layout.parse("tp8pp4dp4", 128), Layout.parse("tp4pp4dp8", 128)
    dev = tuple(range(128))
    bare = switch_memory_plan(spec, src, dev, dst, dev, device_memory_bytes=80 * GiB,
                              activation_bytes=0)
    need = dict((m, b) for m, b, _ in bare.need_bytes)
    # memory outside torch (context, A's NCCL, another process) leaves room for the
    # state of A and B, but not for B's new NCCL communicators too
    nccl = MC.new_communicators(dst) * MC.DEFAULT_NCCL_COMM_BYTES
    outside = 80 * GiB - need["release_a_grads"] - nccl + GiB
    a_state = 20 * GiB
    fake = _FakeDevice(total=80 * GiB, free=80 * GiB - a_state - outside, allocated=a_state,
                       reserved=a_state)
    assert nccl > GiB  # without it the switch would fit, degraded
    monkeypatch.setattr(MC, "agree_on_max", lambda v: v)
    monkeypatch.setattr(H, "choose_dst_placement", lambda *a: Placement(dev))
    built = []
    monkeypatch.setattr(H, "start_preparation", lambda *a, **k: built.append("prepare"))
    monkeypatch.setattr(H, "build_groups", lambda *a: built.append("groups"))

    class Ctl:
        done_with: list = []
        last_request = None

        def done(self, d, outcome, reason=""):
            self.done_with.append((outcome, reason))

    hook = H.DynatrainHook(spec, TrainConfig(), Ctl(), memory=MC.SwitchMemoryCheck(source=fake))
    assert bare.mode is not None  # by the state alone it would have gone ahead
    hook.layout, hook.layout_placement = src, Placement(dev)
    hook._on_decision(Decision("tp4pp4dp8", 128, "signal"), 10)
    assert built == [] and hook.decision is None and hook._sync_target is None
    assert hook.controller.done_with[-1][0] == "failed" and "do not fit" in hook.rejected[-1]


# ----------------------------------------------------------------- issue 27, 3. B's RNG use
def _dropout_masks_while_b_forks(isolate: bool, concurrent: bool) -> list:
    """A draws dropout masks under the model-parallel tracker while B's thread sits inside
    a tracker fork (as Transformer Engine's reset_parameters does at construction)."""
    import threading

    import torch
    from megatron.core.tensor_parallel import random as mrandom

    from dynatrain_megatron.compat import prepare_runtime
    from dynatrain_megatron.compat.private_rng import private_rng

    def get_cuda_rng_tracker():  # looked up at each call, as megatron's modules do
        return mrandom.get_cuda_rng_tracker()

    prepare_runtime()
    torch.manual_seed(7)
    mrandom.model_parallel_cuda_manual_seed(11, tp_rank=0, ep_rank=0, etp_rank=0,
                                            force_reset_rng=True)
    inside, drawn = threading.Event(), threading.Event()

    def b_build():
        ctx = private_rng() if isolate else __import__("contextlib").nullcontext()
        with ctx:
            with get_cuda_rng_tracker().fork():  # TE's init_fn inside is a no-op for B
                inside.set()
                drawn.wait(10)

    t = threading.Thread(target=b_build)
    if concurrent:
        t.start()
        inside.wait(10)
    x = torch.ones(64)
    masks = []
    for _ in range(3):
        with get_cuda_rng_tracker().fork():
            masks.append(torch.nn.functional.dropout(x, 0.1).eq(0))
        masks.append(torch.nn.functional.dropout(x, 0.1).eq(0))  # the default generator
    drawn.set()
    if concurrent:
        t.join()
    for _ in range(2):  # after B's fork ended: the generators must have moved on as A's
        with get_cuda_rng_tracker().fork():
            masks.append(torch.nn.functional.dropout(x, 0.1).eq(0))
        masks.append(torch.nn.functional.dropout(x, 0.1).eq(0))
    return masks


def test_b_construction_leaves_a_dropout_masks_unchanged():
    import torch

    ref = _dropout_masks_while_b_forks(isolate=True, concurrent=False)
    iso = _dropout_masks_while_b_forks(isolate=True, concurrent=True)
    assert all(torch.equal(a, b) for a, b in zip(ref, iso))
    # the control: without the isolation B's fork changes A's masks
    raw = _dropout_masks_while_b_forks(isolate=False, concurrent=True)
    assert not all(torch.equal(a, b) for a, b in zip(ref, raw))


# ----------------------------------------------------------------- issue 27, 4. votes, aborts
def _vote_case(deadline: float) -> dict:
    """On gloo ranks: votes that agree, a vote with one rank's error, a vote with a hung
    peer and one with a dead peer (each on a fresh CPU group, as a broken one is gone)."""
    import os
    import time
    import types

    import torch.distributed as dist

    from dynatrain_megatron.transition import switch as S

    me, out = dist.get_rank(), {}
    groups = [dist.new_group(backend="gloo") for _ in range(3)]
    S.control_group = lambda: groups[0]
    out["ok"] = S._agree([], deadline)
    out["one"] = S._agree(["rank 1: boom"] if me == 1 else [], deadline)
    aborted = []
    S.abort_group = lambda g: aborted.append(g) or True
    released = []
    fake = types.SimpleNamespace(transfer="transfer", release_transfer=lambda: released.append(1))
    if out["one"]:  # what the switch does after a failed commit vote: on every rank
        S._release_transfer(fake, abort=True)
    out["aborted"], out["released"] = aborted, released
    for name, g in (("hung", groups[1]), ("dead", groups[2])):
        S.control_group = lambda g=g: g
        if me == 3:
            if name == "dead":
                os._exit(0)  # gone: its sockets close
            time.sleep(deadline * 2.5)  # hung past everyone's deadline
            out[name] = "skipped"
            continue
        t0 = time.monotonic()
        try:
            S._agree([], deadline)
            out[name] = "result"
        except S.VoteFailed as e:
            out[name] = "VoteFailed"
            out[name + "_msg"] = str(e)
        out[name + "_s"] = time.monotonic() - t0
    return out


@pytest.mark.multirank
def test_votes_agree_and_a_dead_or_hung_peer_fails_every_vote_alike():
    from dynatrain_megatron.testing.multiproc import run_on_ranks

    res = run_on_ranks(_vote_case, 4, 2.0, timeout=300)
    live = res[:3]
    assert res[3] is None  # the dead rank
    assert all(r["ok"] == [] for r in live)
    assert all(r["one"] == ["rank 1: boom"] for r in live)  # everyone sees rank 1's reason
    # the failed vote's outcome is everyone's: every rank aborts and releases the transfer
    assert all(r["aborted"] == ["transfer"] and r["released"] == [1] for r in live)
    # a hung peer: every live rank's vote fails at its deadline, none gets a result
    assert [r["hung"] for r in live] == ["VoteFailed"] * 3
    assert all(1.5 < r["hung_s"] < 10 for r in live), [r["hung_s"] for r in live]
    assert [r["dead"] for r in live] == ["VoteFailed"] * 3


def test_votes_run_on_the_cpu_group_with_a_deadline(monkeypatch):
    """Never on an NCCL communicator (whose abort hands a rank its own value back)."""
    from dynatrain_megatron.transition import switch as S

    cpu_group, seen = object(), []

    class Work:
        def wait(self, timeout=None):
            seen.append(timeout.total_seconds())
            raise RuntimeError("Timed out waiting 2000ms for recv operation to complete")

    monkeypatch.setattr(S, "control_group", lambda: cpu_group)
    monkeypatch.setattr(S, "collective_device", lambda g=None: torch.device(
        "cpu" if g is cpu_group else "cuda"))
    monkeypatch.setattr(S.dist, "all_reduce", lambda t, op=None, group=None, async_op=False:
                        seen.append((t.device.type, group is cpu_group, async_op)) or Work())
    with pytest.raises(S.VoteFailed, match="within 7 s"):
        S._agree([], 7.0)
    assert seen == [("cpu", True, True), 7.0]
    assert S.vote_deadline(None) == S.VOTE_TIMEOUT_S and S.vote_deadline(1000.0) == 4000.0


def test_broken_layout_aborts_its_nccl_communicators_together_then_destroys(monkeypatch):
    """`destroy(broken=True)` after a peer died: every NCCL communicator of the layout is
    aborted inside one NCCL group call (one abort each, however often a group is listed),
    gloo groups and groups this rank is not in are not aborted, and only then is each
    group destroyed, in creation order; a destroy that fails is not fatal."""
    import types

    from dynatrain_megatron.compat import torch_features as tf
    from dynatrain_megatron.elastic import groups as G
    from dynatrain_megatron.transition import transport as T

    calls = []

    class Backend:
        def _group_start(self):
            calls.append("group start")

        def _group_end(self):
            calls.append("group end")

    class Group:
        def __init__(self, name, nccl=True):
            self.name, self.nccl = name, nccl

        def _get_backend(self, device):
            return Backend()

        def abort(self):
            calls.append(f"abort {self.name}")

    tp, dp, twin, transfer = Group("tp"), Group("dp"), Group("twin", nccl=False), Group("xfer")
    non_member = G.dist.GroupMember.NON_GROUP_MEMBER
    monkeypatch.setattr(T, "is_nccl", lambda g=None: g.nccl)
    monkeypatch.setattr(tf, "process_group_abort", lambda: True)

    def destroy(g=None):
        calls.append(f"destroy {g.name}")
        if g is dp:
            raise RuntimeError("communicator already gone")

    monkeypatch.setattr(G.dist, "destroy_process_group", destroy)
    layout = types.SimpleNamespace(created=[tp, non_member, dp, twin, tp, transfer])
    G.ParallelGroups.destroy(layout, broken=True)
    assert calls == ["group start", "abort tp", "abort dp", "abort xfer", "group end",
                     "destroy tp", "destroy dp", "destroy twin", "destroy tp", "destroy xfer"]
    assert layout.created == []
    # a torch whose backend has no group call: aborted one after another all the same
    calls.clear()
    monkeypatch.setattr(Backend, "_group_start", None)
    assert T.abort_groups([tp, twin, dp]) == 2 and calls == ["abort tp", "abort dp"]
    assert T.abort_groups([twin, non_member, None]) == 0


def test_nccl_error_handling_is_set_before_megatron_lm_makes_its_groups(monkeypatch):
    """Plain torchrun + the patched pretrain_gpt.py: our argument provider (run by
    Megatron-LM's parse_args, before torch.distributed exists) sets it; a user's value
    is kept."""
    import argparse

    from dynatrain_megatron.megatron_lm.arguments import chain_extra_args_providers

    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    chain_extra_args_providers(None)(argparse.ArgumentParser())
    import os

    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    chain_extra_args_providers(None)(argparse.ArgumentParser())
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


# ----------------------------------------------------------------- issue 27, 7. preparation deadline
def _prepare_deadline_case(mode: str) -> dict:
    """Rank 2's background preparation fails at once while its peers stay blocked (as in
    an NCCL communicator's set-up that it never joins), or rank 2 stays blocked while
    the others finish: every rank's ready vote gives up alike, in bounded time."""
    import time

    import torch.distributed as dist

    from dynatrain_megatron.elastic import device_manager as DM
    from dynatrain_megatron.vps.placement import Placement

    me = dist.get_rank()

    def build(layout, placement):
        if mode == "fail" and me == 2:
            raise RuntimeError("communicator set-up failed")
        if (mode == "fail") or (mode == "hang" and me == 2):
            time.sleep(30)  # blocked
        return None

    DM.build_groups = build
    dm = DM.DeviceManager(deadline_s=2.0)
    dm.prepare(Layout.parse("tp1", 4), Placement.default(4))
    t0, polls = time.monotonic(), 0
    while not dm.ready():
        time.sleep(0.05)
        polls += 1
        if time.monotonic() - t0 > 20:
            return dict(out="spun", s=time.monotonic() - t0)
    waited = time.monotonic() - t0
    try:
        dm.take()
        out = "took"
    except RuntimeError as e:
        out = str(e)
    t1 = time.monotonic()
    dm.abandon()
    return dict(out=out, s=waited, abandon_s=time.monotonic() - t1)


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["fail", "hang"])
def test_background_preparation_has_a_deadline(mode):
    from dynatrain_megatron.testing.multiproc import run_on_ranks

    res = run_on_ranks(_prepare_deadline_case, 4, mode, timeout=300)
    assert all("failed on some rank" in r["out"] if mode == "fail" else
               "passed its deadline of 2 s" in r["out"] for r in res), res
    bound = 1.5 if mode == "fail" else 8.0  # a failure is seen at once; a hang at 2 s
    assert all(r["s"] < bound and r["abandon_s"] < 1.0 for r in res), res
    if mode == "hang":
        assert all(r["s"] > 1.9 for r in res), res


# ----------------------------------------------------------------- issue 27, 8. gloo groups
def test_no_world_sized_gloo_group_per_switch_under_nccl(monkeypatch):
    """B's CPU twin under NCCL: the control group where B spans the world, one group per
    other device set for the life of the world; none is made again at the next switch."""
    from dynatrain_megatron.elastic import communicators as cm

    class World:  # a default group stand-in (weakly referenced)
        pass

    made, control = [], object()
    worlds = [World()]
    monkeypatch.setattr(cm, "is_nccl", lambda group=None: True)
    monkeypatch.setattr(cm, "control_group", lambda: control)
    monkeypatch.setattr(cm.dist, "get_world_size", lambda group=None: 8)
    monkeypatch.setattr(cm.dist.distributed_c10d, "_get_default_group", lambda: worlds[-1])
    monkeypatch.setattr(cm.dist, "new_group", lambda ranks=None, backend=None, **k:
                        made.append((tuple(ranks), backend)) or object())
    for _ in range(3):  # three switches among layouts on the whole world
        assert cm.cpu_group_for((3, 1, 0, 2, 4, 5, 7, 6)) is control
    first = [cm.cpu_group_for((0, 1, 2, 3)) for _ in range(3)]  # scale-in, and back, ...
    assert made == [((0, 1, 2, 3), "gloo")] and first[0] is first[1] is first[2]
    worlds.append(World())  # a new world (after a death): made again, once
    cm.cpu_group_for((0, 1, 2, 3))
    assert len(made) == 2


# ----------------------------------------------------------------- issue 27, 9. B's options
def test_b_groups_get_the_jobs_nccl_options(monkeypatch, tmp_path):
    """Megatron-LM's --nccl-communicator-config-path and --high-priority-stream-groups:
    each of B's NCCL groups so named is made with megatron's own options for that name
    (as far as the CPU can tell: the options object is megatron-core's get_nccl_options's),
    the others with torch's defaults."""
    import types

    import megatron.core.parallel_state as ps

    from dynatrain_megatron.elastic import groups as G

    cfg = tmp_path / "nccl.yaml"
    cfg.write_text("tp: {max_ctas: 8}\ndp_cp: {net_name: IB, min_ctas: 2}\n")
    args = types.SimpleNamespace(nccl_communicator_config_path=str(cfg),
                                 high_priority_stream_groups=["pp"])
    opts = G.GroupOptions.from_megatron_args(args)
    assert opts.config() == {"tp": {"max_ctas": 8}, "dp_cp": {"net_name": "IB", "min_ctas": 2},
                             "pp": {"is_high_priority_stream": True}}
    made = []
    monkeypatch.setattr(ps, "get_nccl_options", lambda name, c: ("megatron", name, str(c[name])))
    monkeypatch.setattr(G, "is_nccl", lambda group=None: True)
    monkeypatch.setattr(G, "group_device", lambda: None)
    monkeypatch.setattr(G, "cpu_group_for", lambda dev: "cpu")
    monkeypatch.setattr(G.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(G.dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(G.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(G, "new_group", lambda ranks, **k: made.append((tuple(ranks), k)) or
                        object())
    G.set_group_options(opts)
    try:
        G.build_groups(Layout.parse("tp2pp2", 4))
    finally:
        G.set_group_options(G.GroupOptions())
    with_opts = {k["pg_options"][1]: k["pg_options"] for _, k in made if k.get("pg_options")}
    assert set(with_opts) == {"tp", "pp", "dp_cp"}
    assert with_opts["pp"] == ("megatron", "pp", "{'is_high_priority_stream': True}")
    # dp_cp has the same members as dp (cp 1) but its own group, with its options
    dp_like = [r for r, k in made if r == (0,)]
    assert len(dp_like) >= 2


# the job's args Megatron-LM's get_model makes a DDP config from besides the config's own
# field names (facts of core_v0.16.1 and core_v0.19.0's training.py)
_DDP_RENAMED_ARGS = ("accumulate_allreduce_grads_in_fp32", "check_for_nan_in_loss_and_grad",
                     "check_for_large_grads", "ddp_bucket_size", "ddp_num_buckets",
                     "ddp_average_in_collective", "ddp_pad_buckets_for_high_nccl_busbw")
# what B's args may differ in from the job's: its layout, and how B's weights are made
_LAYOUT_ARGS = {"tensor_model_parallel_size", "pipeline_model_parallel_size",
                "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                "context_parallel_size", "expert_model_parallel_size",
                "expert_tensor_parallel_size", "data_parallel_size", "world_size", "rank",
                "num_distributed_optimizer_instances", "decoder_first_pipeline_num_layers",
                "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
                "account_for_loss_in_pipeline_split", "padded_vocab_size", "sequence_parallel",
                "overlap_p2p_comm", "tp_comm_overlap", "use_cpu_initialization",
                "data_parallel_random_init", "init_model_with_meta_device",
                "enable_gloo_process_groups", "align_param_gather"}


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_b_ddp_config_comes_from_the_jobs_args_field_for_field(monkeypatch, backend):
    """Inside Megatron-LM, B's DDP config is made by Megatron-LM's own get_model from a copy
    of the job's args set to B (megatron_lm/builder.py). That copy equals the job's args in
    every attribute but B's layout and weight-making ones; in particular every argument a
    DDP config is made from (each config field's namesake and the renamed flags) is the
    job's, but the optimizer-instance count, which is B's, and the aligned parameter
    gather, which Megatron-LM's validation turns off without VPP. (That Megatron-LM's own
    functions turn these args into the configs Megatron-LM makes at B is
    test_megatron_lm_config.py's `test_b_ddp_and_optimizer_configs_are_megatron_lm_own_at_b`.)"""
    import dataclasses
    import types

    from megatron.core.distributed import DistributedDataParallelConfig

    from dynatrain_megatron.megatron_lm.builder import MegatronLMBuilder
    from dynatrain_megatron.megatron_lm.transformer_config import JobIntents
    from dynatrain_megatron.mcore.train_config import TrainConfig

    ddp_args = [f.name for f in dataclasses.fields(DistributedDataParallelConfig)]
    ddp_args += list(_DDP_RENAMED_ARGS)
    job = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
               data_parallel_size=2, world_size=8, rank=0, sequence_parallel=True,
               enable_gloo_process_groups=True, hidden_dropout=0.1, lr=3e-4, seed=1234,
               transformer_impl="transformer_engine", nccl_communicator_config_path="/x.yaml")
    # every DDP source set to a value of its own (not a default), so a reset would show
    job.update({n: ("job", n) for n in ddp_args})
    job["num_distributed_optimizer_instances"] = 1
    args = types.SimpleNamespace(**job)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    builder = MegatronLMBuilder(TINY_GPT, TrainConfig(), args=args,
                                intents=JobIntents.from_args(args),
                                model_provider=lambda *x: None)
    b = Layout.parse("tp1pp2dp4", 8)
    b_args = builder.args_for(b, types.SimpleNamespace(rank=5), init_weights=False)
    assert vars(args) == job  # the job's own args are untouched
    for n in ddp_args:
        if n not in ("num_distributed_optimizer_instances", "align_param_gather"):
            assert getattr(b_args, n) is getattr(args, n), n
    assert b_args.num_distributed_optimizer_instances == b.doi
    assert b_args.align_param_gather is False  # B has no VPP
    differ = {k for k in set(vars(args)) | set(vars(b_args))
              if getattr(args, k, None) != getattr(b_args, k, None)}
    assert differ <= _LAYOUT_ARGS, differ - _LAYOUT_ARGS
    assert b_args.tensor_model_parallel_size == 1 and b_args.data_parallel_size == 4
    # B's groups have no gloo twins under NCCL (megatron's legacy checkpoint formats only)
    assert b_args.enable_gloo_process_groups is (backend == "gloo")


def test_aligned_param_gather_follows_vpp_as_megatron_lm_validation_does():
    """`align_param_gather` (a DDP config field, and what `train()` reads to set the
    param-sync callback) is off without VPP after Megatron-LM's validation: a job without
    VPP switching to VPP gets it back (unless `--no-align-param-gather` was given, which
    only a VPP job's args show), and a VPP job switching away turns it off."""
    import types

    from dynatrain_megatron.megatron_lm.transformer_config import JobIntents, settings_at

    def job(vpp, align):
        return types.SimpleNamespace(tensor_model_parallel_size=1, overlap_p2p_comm=vpp > 1,
                                     virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                     align_param_gather=align)

    vpp, plain = Layout.parse("tp1pp2vpp2dp2", 4), Layout.parse("tp1pp4", 4)
    no_vpp_job = job(1, False)  # validated: off without VPP whatever was asked
    assert settings_at(no_vpp_job, vpp, JobIntents.from_args(no_vpp_job))["align_param_gather"]
    for align in (True, False):
        a = job(2, align)
        assert settings_at(a, vpp, JobIntents.from_args(a))["align_param_gather"] is align
        assert settings_at(a, plain, JobIntents.from_args(a))["align_param_gather"] is False
    older = types.SimpleNamespace(tensor_model_parallel_size=1)  # a release without the flag
    assert "align_param_gather" not in settings_at(older, vpp, JobIntents.from_args(older))


def test_options_we_cannot_honour_are_refused_at_start():
    import types

    from dynatrain_megatron.megatron_lm.support import unsupported_args

    base = dict(transformer_impl="local", use_distributed_optimizer=True, seq_length=32)
    assert not any("pad-buckets" in x or "sharp" in x
                   for x in unsupported_args(types.SimpleNamespace(**base)))
    bad = unsupported_args(types.SimpleNamespace(**base, ddp_pad_buckets_for_high_nccl_busbw=True,
                                                 use_sharp=True))
    # padded buckets switch, planned from the live metadata (the distributed optimizer's
    # own ranges); SHARP stays refused
    assert not any("--ddp-pad-buckets-for-high-nccl-busbw" in x for x in bad)
    assert any("--use-sharp" in x for x in bad)


# ----------------------------------------------------------------- issue 27, 5. scale-in destroy
def _transfer_release_case() -> dict:
    import torch.distributed as dist

    from dynatrain_megatron.elastic import groups as G
    from dynatrain_megatron.vps.placement import Placement

    b = G.build_groups(Layout.parse("tp2", 2), Placement((0, 1)))  # scale-in: B on 0, 1
    transfer, log = b.transfer, []
    real = dist.destroy_process_group

    def record(g=None):
        log.append("transfer" if g is transfer else
                   "member" if g != dist.GroupMember.NON_GROUP_MEMBER else "non-member")
        real(g)

    dist.destroy_process_group = record
    try:
        b.release_transfer()  # every rank, after the switch's last vote
        at_release = list(log)
        b.release_transfer()  # idempotent
        b.destroy()  # later, with B's objects: only B's members hold communicators
    finally:
        dist.destroy_process_group = real
    return dict(at_release=at_release, later=log[len(at_release):],
                transfer_kept=any(g is transfer for g in b.created))


@pytest.mark.multirank
def test_transfer_group_destroyed_by_every_rank_together_on_scale_in():
    from dynatrain_megatron.testing.multiproc import run_on_ranks

    res = run_on_ranks(_transfer_release_case, 4, timeout=300)
    assert [r["at_release"] for r in res] == [["transfer"]] * 4  # the leaving ranks too
    assert not any(r["transfer_kept"] for r in res)
    assert all("transfer" not in r["later"] and "non-member" not in r["later"] for r in res)
    assert res[2]["later"] == res[3]["later"] == []  # nothing of B's on the leaving ranks
    assert res[0]["later"] == res[1]["later"] and res[0]["later"]  # members, one order


def _first_layout_groups_case() -> dict:
    """megatron-core's own initialize_model_parallel (as Megatron-LM calls it at start,
    gloo twins included), wrapped as the first layout, then released."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from dynatrain_megatron.compat import prepare_runtime
    from dynatrain_megatron.megatron_lm.adapter import wrap_megatron_groups

    prepare_runtime()
    registry = dist.distributed_c10d._world.pg_map
    before = len(registry)
    ps.initialize_model_parallel(2, 2, create_gloo_process_groups=True)
    made = len(registry) - before
    held: dict = {}  # group -> (its first global name, its members): same on every member
    for k, v in sorted(vars(ps).items()):
        if isinstance(v, dist.ProcessGroup) and v is not dist.group.WORLD:
            held.setdefault(id(v), (k, tuple(dist.get_process_group_ranks(v))))
    groups = wrap_megatron_groups(Layout.parse("tp2pp2", 4))
    order = [held.get(id(g)) for g in groups.created]
    destroyed = []
    real = dist.destroy_process_group
    dist.destroy_process_group = lambda g=None: destroyed.append(held.get(id(g))) or real(g)
    try:
        groups.destroy()  # what releasing the first layout does, on every rank
    finally:
        dist.destroy_process_group = real
    left = len(registry) - before
    ps.destroy_model_parallel()
    return dict(made=made, order=order, destroyed=destroyed, all_held=len(set(held.values())),
                left=left)


@pytest.mark.multirank
def test_megatron_lm_first_layout_groups_are_destroyed_with_it():
    """Issue 27, 10: the groups Megatron-LM made for the first layout (megatron-core's
    parallel_state, gloo twins included) belong to that layout and are destroyed with it,
    every rank in the same order; torch's registry keeps none of them."""
    from dynatrain_megatron.testing.multiproc import run_on_ranks

    res = run_on_ranks(_first_layout_groups_case, 4, timeout=300)
    for me, r in enumerate(res):
        assert r["made"] > 4 and r["left"] == 0, r  # every group megatron made is gone
        assert None not in r["order"] and r["destroyed"] == r["order"], r
        assert len(r["order"]) == r["all_held"]  # every distinct group megatron holds
        for name, members in r["order"]:  # each of its members destroys it too
            assert all((name, members) in res[m]["order"] for m in members), (me, name)
    # any two ranks destroy the groups they share in the same order
    for a in res:
        for b in res:
            common = [g for g in a["order"] if g in b["order"]]
            assert common == [g for g in b["order"] if g in a["order"]]


def test_releasing_a_layout_with_tp_comm_overlap_frees_tes_user_buffers(monkeypatch):
    """`--tp-comm-overlap`: TE's user buffers were set up once for the first layout; the
    layout built by a switch runs without them, so releasing the layout that had them
    frees them (TE's own `destroy_ub`), and a layout without the overlap leaves TE alone."""
    import sys
    import types

    from dynatrain_megatron.mcore import session as S

    base = types.ModuleType("transformer_engine.pytorch.module.base")
    base._ub_communicators = {("qkv_fprop", 0): object()}
    base.destroy_ub = lambda: setattr(base, "_ub_communicators", None)
    names = ("transformer_engine", "transformer_engine.pytorch",
             "transformer_engine.pytorch.module")
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, base.__name__, base)
    sys.modules["transformer_engine.pytorch.module"].base = base
    monkeypatch.setattr(S, "collect_released", lambda: None)

    class Groups:
        def destroy(self, broken):
            pass

        def take_handles(self):
            return []

    def objs(overlap):
        cfg = types.SimpleNamespace(tp_comm_overlap=overlap)
        return types.SimpleNamespace(config=cfg, groups=Groups(), model=[torch.nn.Linear(2, 2)],
                                     optimizer=object(), scheduler=object())

    S.release(objs(False))
    assert base._ub_communicators is not None  # B (no overlap) released: TE untouched
    S.release(objs(True))
    assert base._ub_communicators is None
    assert S.free_te_user_buffers() is False  # nothing left to free


def test_a_warm_up_failure_is_carried_to_the_switch_vote_not_raised_alone(monkeypatch):
    """After the ready vote `take` raises on every rank alike or on none: a failure of this
    rank's NCCL warm-up rides in the preparation to the switch's first vote (every rank
    then gives up together); with no preparation to carry it, it is raised."""
    from types import SimpleNamespace

    from dynatrain_megatron.elastic import device_manager as dm
    from dynatrain_megatron.transition.switch_types import Prepared
    from dynatrain_megatron.vps import OPT_KINDS, Layout, Placement

    a, b, pl = Layout.parse("tp2pp2dp1"), Layout.parse("tp1pp2dp2"), Placement((0, 1, 2, 3))
    groups = SimpleNamespace(layout=b, placement=pl)
    monkeypatch.setattr(dm, "build_groups", lambda layout, where: groups)
    monkeypatch.setattr(dm.dist, "get_rank", lambda group=None: 3)

    def broken(res):
        raise RuntimeError("ncclInternalError")
    monkeypatch.setattr(dm, "warm_up_groups", broken)
    m = dm.DeviceManager(device=None)
    m.prepare(b, pl, background=False,
              then=lambda g: Prepared(a, pl, b, pl, groups=g, kinds=OPT_KINDS))
    assert m.take() is groups
    prep = m.take_prepared()
    assert prep.error == ("rank 3: warming up B's communicators: RuntimeError: "
                          "ncclInternalError")
    m = dm.DeviceManager(device=None)
    m.prepare(b, pl, background=False)  # groups only: nothing carries it
    with pytest.raises(RuntimeError, match="ncclInternalError"):
        m.take()


@pytest.mark.parametrize("nccl", [True, False])
def test_pipeline_warm_up_exchanges_with_both_neighbours_at_its_backends_call_site(
        monkeypatch, nccl):
    """One element each way with the previous and the next stage on B's pipeline group
    only: under NCCL at the safe point (not from the preparation thread), under gloo from
    the preparation thread (not at the safe point, where it would be in the pause)."""
    from types import SimpleNamespace

    from dynatrain_megatron.elastic import communicators as cm

    pp, other = object(), object()
    posted = []
    monkeypatch.setattr(cm, "is_nccl", lambda group=None: nccl)
    monkeypatch.setattr(cm, "collective_device", lambda group=None: torch.device("cpu"))
    monkeypatch.setattr(cm.dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(cm.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(cm.dist, "get_global_rank", lambda group, r: 10 + r)
    monkeypatch.setattr(cm.dist, "P2POp", lambda op, t, peer, group=None: (op, peer, group))
    monkeypatch.setattr(cm.dist, "batch_isend_irecv", lambda ops: posted.extend(ops) or [])
    groups = SimpleNamespace(pg_collection=SimpleNamespace(pp=pp, tp=other))
    assert cm.warm_up_pipeline(groups, in_background=nccl) is False and posted == []
    assert cm.warm_up_pipeline(groups, in_background=not nccl) is True
    # stage 0 of 4: its neighbours are stages 1 and 3 (the wrap-around of interleaving)
    assert posted == [(cm.dist.isend, 11, pp), (cm.dist.irecv, 11, pp),
                      (cm.dist.isend, 13, pp), (cm.dist.irecv, 13, pp)]
    monkeypatch.setattr(cm.dist, "get_world_size", lambda group=None: 1)
    assert cm.warm_up_pipeline(groups, in_background=not nccl) is False  # one stage
