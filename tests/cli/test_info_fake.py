"""``ctxkit info`` against the fake driver: devices, the peer matrix, a driver with no device."""

from __future__ import annotations

import io

import pytest

from ctxkit.cli import info
from ctxkit.device import Device


@pytest.fixture
def fake_gpus(fake_driver, monkeypatch):
    monkeypatch.setattr(Device, "name", property(lambda self: f"Fake GPU {self.ordinal}"))
    monkeypatch.setattr(Device, "compute_capability", property(lambda self: (9, 0)))
    monkeypatch.setattr(Device, "total_memory", property(lambda self: 141 << 30))
    monkeypatch.setattr(Device, "multiprocessor_count", property(lambda self: 132))
    monkeypatch.setattr(Device, "pci_bus_id", property(lambda self: f"0000:0{self.ordinal}:00.0"))
    monkeypatch.setattr(Device, "can_access_peer", lambda self, other: self.ordinal == 0)
    return fake_driver


def test_two_gpus_and_their_peer_matrix(fake_gpus) -> None:
    out = io.StringIO()
    assert info.print_info(out) == 0
    text = out.getvalue()
    assert "devices       : 2" in text and "driver (CUDA) : 13.0" in text
    assert "[1] Fake GPU 1  cc 9.0  141.0 GiB  SMs 132  PCI 0000:01:00.0" in text
    rows = text.split("peer access (row can access column):\n")[1].splitlines()
    assert rows[1].split() == ["0", "-", "yes"] and rows[2].split() == ["1", "no", "-"]
    assert "no GPU" not in text


def test_a_driver_with_no_device_ends_with_no_gpu(fake_gpus) -> None:
    fake_gpus.ndev = 0
    out = io.StringIO()
    assert info.print_info(out) == 0
    text = out.getvalue()
    assert "devices       : 0" in text
    assert text.strip().splitlines()[-1] == "no GPU        : the driver reports no CUDA device"
