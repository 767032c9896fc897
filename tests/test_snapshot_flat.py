"""The layout of a snapshot's copies from CUDA tensors (``_DEVICE_COPIES = "flat"``): the tensors of a dtype land in one
host buffer, one after another, as views of it, in the order the state is walked; the buffers of a snapshot given up
are written over by the next one. Run here with CPU tensors standing in for CUDA ones and the copies made at once; the
copies themselves (a gathering copy on the device, one transfer on a side stream) are tested in test_cuda.py."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_monitor import snapshot


def _stand_in(monkeypatch):
    monkeypatch.setattr(snapshot, "_DEVICE_COPIES", "flat")
    monkeypatch.setattr(snapshot, "_async_source",
                        lambda t: type(t) is Tensor and t.layout == torch.strided and t.is_floating_point())

    def copy_now(dst, src, pending, flats=None):
        assert flats is not None  # the flat layout was asked for
        for d, t in zip(dst, src):
            d.copy_(t)
        pending.append("stream")

    monkeypatch.setattr(snapshot, "_copy_from_devices", copy_now)


def _state(scale: float = 1.0, rows: int = 3) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": scale * torch.randn(rows, 4, generator=g), "n": 7,
            "groups": [torch.nn.Parameter(scale * torch.randn(5, generator=g)),
                       {"d": scale * torch.randn(2, 2, generator=g, dtype=torch.float64), "i": torch.arange(4)}]}


def _base(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_the_copies_of_a_dtype_are_views_of_one_buffer_in_walking_order(monkeypatch):
    _stand_in(monkeypatch)
    src, flats, pending = _state(), {}, []
    out = snapshot._to_host(src, None, pending, flats)
    assert pending == ["stream"]
    assert torch.equal(out["w"], src["w"]) and torch.equal(out["groups"][0], src["groups"][0].detach())
    assert torch.equal(out["groups"][1]["d"], src["groups"][1]["d"]) and out["n"] == 7
    assert type(out["groups"][0]) is Tensor and not out["groups"][0].requires_grad
    f32, f64 = flats[(torch.device("cpu"), torch.float32)], flats[(torch.device("cpu"), torch.float64)]
    assert f32.numel() == 3 * 4 + 5 and f64.numel() == 4 and len(flats) == 2
    # one after another in the order walked: w, then the parameter
    assert out["w"].data_ptr() == f32.data_ptr() and out["groups"][0].data_ptr() == f32.data_ptr() + 12 * 4
    assert _base(out["groups"][1]["d"]) == f64.data_ptr()
    assert torch.equal(out["groups"][1]["i"], torch.arange(4)) and _base(out["groups"][1]["i"]) != f32.data_ptr()
    # the sources are untouched by later changes of the copies
    out["w"].zero_()
    assert src["w"].abs().sum() > 0


def test_the_next_snapshot_writes_over_the_buffers_of_the_one_given_up(monkeypatch):
    _stand_in(monkeypatch)
    flats: dict = {}
    first = snapshot._to_host(_state(), None, [], flats)
    buffers = {k: v.data_ptr() for k, v in flats.items()}
    second = snapshot._to_host(_state(scale=2.0), None, [], flats)
    assert {k: v.data_ptr() for k, v in flats.items()} == buffers
    assert torch.equal(second["w"], _state(scale=2.0)["w"]) and first["w"].data_ptr() == second["w"].data_ptr()
    # a state of another size gets a buffer of its own for that dtype; the other dtype's is written over
    third = snapshot._to_host(_state(rows=6), None, [], flats)
    assert flats[(torch.device("cpu"), torch.float32)].numel() == 6 * 4 + 5
    assert flats[(torch.device("cpu"), torch.float64)].data_ptr() == buffers[(torch.device("cpu"), torch.float64)]
    assert torch.equal(third["w"], _state(rows=6)["w"])
