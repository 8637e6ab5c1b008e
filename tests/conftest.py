import os
import sys

# spawned ranks import test modules by name: make tests/ importable for them
sys.path.insert(0, os.path.dirname(__file__))

# before any test module imports megatron-core: its fusion decorators need not import
# TorchInductor on a CPU machine (compat.cpu.defer_torch_compile)
from dynatrain_megatron.compat.cpu import defer_torch_compile  # noqa: E402

defer_torch_compile()


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _collections_left_as_found(request):
    """A test that leaves Python's automatic garbage collection disabled fails (a switch
    pauses it until B's first steps are measured; every other path must resume it), and
    the tests after it start with collections on."""
    enabled = gc.isenabled()
    yield
    if enabled and not gc.isenabled():
        gc.enable()
        pytest.fail(f"{request.node.nodeid} left automatic garbage collection disabled")


@pytest.fixture(scope="session", autouse=True)
def _megatron_lm_launch_servers(tmp_path_factory):
    """The session's working copies of the Megatron-LM snapshot (`megatron_lm_tree.copy_tree`)
    and its preloaded launchers for them (`megatron_lm_runs.torchrun_cmd`,
    `dynatrain_megatron/testing/launch_server.py`); each launcher ends with the session."""
    os.environ["DYNATRAIN_TEST_LAUNCH_SERVERS"] = str(tmp_path_factory.mktemp("launch-servers"))
    os.environ["DYNATRAIN_TEST_TREES"] = str(tmp_path_factory.mktemp("megatron-lm-trees"))
    yield
    os.environ.pop("DYNATRAIN_TEST_LAUNCH_SERVERS", None)
    os.environ.pop("DYNATRAIN_TEST_TREES", None)


@pytest.fixture(scope="session", autouse=True)
def _megatron_lm_data_cache(tmp_path_factory):
    """One index cache for the session's Megatron-LM jobs on mock data
    (`megatron_lm_runs.with_data_cache`)."""
    os.environ["DYNATRAIN_TEST_DATA_CACHE"] = str(tmp_path_factory.mktemp("megatron-data-cache"))
    yield
    os.environ.pop("DYNATRAIN_TEST_DATA_CACHE", None)
