"""Launch configuration without a driver: grid/block shapes, limit explanations and
:class:`~ctxkit.module.kernel.LaunchConfig`."""

from __future__ import annotations

import numpy as np
import pytest

from ctxkit.module import kernel as L

# --- launch configuration ---------------------------------------------------------------


def test_normalize_dims():
    assert L.normalize_dims(5, "grid") == (5, 1, 1)
    assert L.normalize_dims((2, 3), "grid") == (2, 3, 1)
    assert L.normalize_dims([2, 3, 4], "block") == (2, 3, 4)
    assert L.normalize_dims(np.int64(7), "grid") == (7, 1, 1)
    with pytest.raises(ValueError, match="1 to 3 dimensions"):
        L.normalize_dims((1, 1, 1, 1), "grid")
    with pytest.raises(ValueError, match="positive"):
        L.normalize_dims(0, "block")
    with pytest.raises(ValueError, match="positive"):
        L.normalize_dims((4, -1), "grid")
    with pytest.raises(ValueError, match="positive"):
        L.normalize_dims(2**32, "grid")
    with pytest.raises(TypeError, match="block must be an int or a tuple"):
        L.normalize_dims(2.0, "block")
    with pytest.raises(TypeError, match="grid must be"):
        L.normalize_dims("64", "grid")


H200 = {
    "max_threads_per_block": 1024,
    "max_block_dim_x": 1024,
    "max_block_dim_y": 1024,
    "max_block_dim_z": 64,
    "max_grid_dim_x": 2**31 - 1,
    "max_grid_dim_y": 65535,
    "max_grid_dim_z": 65535,
    "max_dynamic_shared": 49152,
    "max_shared_optin": 232448,
    "static_shared": 0,
    "num_regs": 16,
    "regs_per_block": 65536,
}


def test_explain_launch_config():
    ok = L.explain_launch_config((1, 1, 1), (256, 1, 1), 0, H200)
    assert ok == []
    big = L.explain_launch_config((1, 1, 1), (2048, 1, 1), 0, H200)
    assert any("2048 threads, more than this kernel's limit of 1024" in r for r in big)
    assert any("block.x = 2048 exceeds the device maximum 1024" in r for r in big)
    z = L.explain_launch_config((1, 70000, 1), (1, 1, 128), 0, H200)
    assert any("block.z = 128" in r for r in z) and any("grid.y = 70000" in r for r in z)
    shm = L.explain_launch_config((1, 1, 1), (32, 1, 1), 100_000, H200)
    assert any("opting in" in r and "max_dynamic_shared_size_bytes" in r for r in shm)
    huge = L.explain_launch_config((1, 1, 1), (32, 1, 1), 300_000, H200)
    assert any("even opted in" in r for r in huge)
    req = L.explain_launch_config((1, 1, 1), (128, 1, 1), 0, {**H200, "reqntid": 256})
    assert any("exactly 256 threads" in r for r in req)
    limits = {**H200, "max_threads_per_block": 512, "num_regs": 128}
    regs = L.explain_launch_config((1, 1, 1), (1024, 1, 1), 0, limits)
    assert any("128 registers per thread" in r for r in regs)


# --- LaunchConfig ----------------------------------------------------------------------


def test_launch_config_normalizes_and_validates():
    cfg = L.LaunchConfig(cluster=2)
    assert cfg.cluster == (2, 1, 1) and not cfg.empty
    assert L.LaunchConfig(cluster=[2, 2]).cluster == (2, 2, 1)
    assert L.LaunchConfig().empty and L.LaunchConfig(cluster=None, priority=None).empty
    assert hash(L.LaunchConfig(cooperative=True)) == hash(L.LaunchConfig(cooperative=True))
    with pytest.raises(TypeError, match="cooperative must be a bool"):
        L.LaunchConfig(cooperative=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="programmatic_stream_serialization must be a bool"):
        L.LaunchConfig(programmatic_stream_serialization="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="priority must be an int"):
        L.LaunchConfig(priority=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cluster dimensions must be positive"):
        L.LaunchConfig(cluster=(2, 0))
    with pytest.raises(ValueError, match="cluster must have 1 to 3 dimensions"):
        L.LaunchConfig(cluster=(1, 1, 1, 1))
    with pytest.raises(AttributeError):
        cfg.cooperative = True  # type: ignore[misc]


def test_launch_config_describes_what_is_set():
    cfg = L.LaunchConfig(True, (2, 1, 1), True, -1)
    assert cfg.describe() == (
        "cooperative=True, cluster=(2, 1, 1), programmatic_stream_serialization=True, priority=-1"
    )
    assert L.LaunchConfig().describe() == ""


def test_launch_attributes_carry_each_option():
    cfg = L.LaunchConfig(True, (4, 2, 1), True, -2)
    attrs = cfg.attributes()
    assert cfg.attributes() is attrs  # built once per config
    by_id = {a.id.name.removeprefix("CU_LAUNCH_ATTRIBUTE_"): a.value for a in attrs}
    assert set(by_id) == {
        "COOPERATIVE",
        "CLUSTER_DIMENSION",
        "PROGRAMMATIC_STREAM_SERIALIZATION",
        "PRIORITY",
    }
    assert by_id["COOPERATIVE"].cooperative == 1
    dim = by_id["CLUSTER_DIMENSION"].clusterDim
    assert (dim.x, dim.y, dim.z) == (4, 2, 1)
    assert by_id["PROGRAMMATIC_STREAM_SERIALIZATION"].programmaticStreamSerializationAllowed == 1
    assert by_id["PRIORITY"].priority == -2
    assert L.LaunchConfig().attributes() == []
    native = L.native_config((8, 2, 1), (32, 4, 1), 128, None, attrs)
    assert (native.gridDimX, native.gridDimY, native.blockDimY, native.sharedMemBytes) == (
        8,
        2,
        4,
        128,
    )
    assert native.numAttrs == 4 and native.attrs[1].value.clusterDim.y == 2


def test_config_for_keywords_and_config():
    assert L.config_for(None, False, None).empty
    coop = L.config_for(None, True, None)
    assert coop.cooperative and coop is L.config_for(None, True, None)
    assert L.config_for(None, False, [2, 1]).cluster == (2, 1, 1)  # a list is not cached
    given = L.LaunchConfig(priority=1)
    assert L.config_for(given, False, None) is given
    with pytest.raises(TypeError, match="either as config=LaunchConfig"):
        L.config_for(given, True, None)
    with pytest.raises(TypeError, match="config must be a ctxkit LaunchConfig"):
        L.config_for({"cooperative": True}, False, None)  # type: ignore[arg-type]


def test_shared_mem_arg():
    assert L.shared_mem_arg(0, "k") == 0 and L.shared_mem_arg(4096, "k") == 4096
    for bad in (-1, 1.5, True, "64"):
        with pytest.raises(ValueError, match="launch of 'k': shared_mem must be a non-negative"):
            L.shared_mem_arg(bad, "k")
