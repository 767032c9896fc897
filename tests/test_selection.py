from __future__ import annotations

import pytest
from torch import nn

from lightning_monitor.selection import select_modules


def _model():
    return nn.Sequential(
        nn.Linear(4, 8),
        nn.ModuleDict({"attn": nn.Linear(8, 8), "norm": nn.LayerNorm(8), "mlp": nn.Sequential(nn.Linear(8, 8))}),
        nn.Linear(8, 2),
    )


def test_select_by_type_include_exclude():
    m = _model()
    assert list(select_modules(m)) == ["0", "1.attn", "1.mlp.0", "2"]
    assert list(select_modules(m, include="1.*")) == ["1.attn", "1.mlp.0"]
    assert list(select_modules(m, exclude=["2", "1.mlp*"])) == ["0", "1.attn"]
    assert list(select_modules(m, types=(nn.LayerNorm,))) == ["1.norm"]


def test_patterns_that_match_nothing_raise_with_names():
    with pytest.raises(ValueError, match=r"`include` pattern 'blocks\.\*'.*Module names are: '0'"):
        select_modules(_model(), include="blocks.*")
    with pytest.raises(ValueError, match="`exclude` module name 'head'"):
        select_modules(_model(), exclude="head")


def test_included_name_of_wrong_type_raises():
    with pytest.raises(ValueError, match="LayerNorm"):
        select_modules(_model(), include="1.norm")
    with pytest.raises(TypeError, match="include"):
        select_modules(_model(), include=["0", 3])
