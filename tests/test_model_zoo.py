"""The model zoo: tiny random-init models of the families people train (Hugging Face GPT-2, Llama, BERT,
ViT; a torchvision-style ResNet with BatchNorm; an MLP; nn.MultiheadAttention; an LSTM), each trained a
few steps in Trainer.fit with every monitor on and a TensorBoard logger. Every value logged is read back
from the event files and must be finite; the noise-scale coverage is logged, and what each monitor
covers, leaves out or cannot watch is what the model's structure says (the same zoo writes
docs/model_coverage.md: benchmarks/coverage_table.py)."""

from __future__ import annotations

import math
import re
import os
import sys

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from coverage_table import STEPS, fit_zoo_model, uncovered_modules, zoo  # noqa: E402

ZOO = {entry.family.split(" (")[0]: entry for entry in zoo()}

#: per family: monitors that stay idle (nothing to watch), and the modules the per-example norms leave out
EXPECTED = {
    "HF GPT-2": ((), {"model.transformer.wpe"}),
    "HF Llama": ((), set()),
    # OPT's learned positions (they take the attention mask) and its MLPs (on the batch flattened with the positions)
    "HF OPT": ((), set()),
    "HF BERT": ((), {"model.bert.embeddings.position_embeddings"}),
    "HF ViT": ((), {"model.vit.embeddings"}),
    # every convolution feeds a BatchNorm in training mode (the batch's statistics couple the examples): only the head
    "ResNet": ((), {"model.bn1", *(f"model.layer{i}.{j}.bn{k}" for i in (1, 2) for j in (0, 1) for k in (1, 2)),
                    "model.layer2.0.downsample.1", "model.conv1",
                    *(f"model.layer{i}.{j}.conv{k}" for i in (1, 2) for j in (0, 1) for k in (1, 2)),
                    "model.layer2.0.downsample.0"}),
    "MLP": ((), set()),
    "nn.MultiheadAttention classifier": ((), set()),
    "LSTM classifier": (("SpectralAlignment", "GradientEarlyStopping"), set()),  # the LSTM covered too
}


@pytest.mark.parametrize("family", list(ZOO))
def test_every_monitor_on_every_family(tmp_path, recwarn, family: str) -> None:
    run = fit_zoo_model(ZOO[family], str(tmp_path))
    idle, left_out = EXPECTED[family]

    # every value logged is finite (read back from the event files)
    assert run.scalars, "nothing logged"
    bad = {k: v for k, series in run.scalars.items() for _, v in series if not math.isfinite(v)}
    assert not bad, bad
    assert len(run.scalars["train/loss"]) == STEPS

    # monitors with nothing to watch said so once and stayed idle; the others logged
    assert {n for n, m in run.monitors.items() if m.idle_reason is not None} == set(idle)
    said = [a for a in run.alerts if a.kind == "nothing_to_watch"]
    assert len(said) == len(idle) and all(a.severity == "warning" for a in said)
    prefixes = {"SpectralAlignment": "sa/", "GradientNoiseScale": "gns/", "GradientWeightAlignment": "gwa/",
                "GradientEarlyStopping": "grades/"}
    for name, prefix in prefixes.items():
        logged = any(k.startswith(prefix) for k in run.scalars)
        assert logged == (name not in idle), name

    # coverage of the per-example norms: logged at every check, < 1 exactly where something is left out,
    # and the left-out modules named with a reason in one warning alert
    coverage = [v for _, v in run.scalars["gns/coverage"]]
    assert len(coverage) == STEPS // 2
    mon = run.monitors["GradientNoiseScale"]
    assert set(uncovered_modules(mon)) == left_out
    assert all(reason for reason in uncovered_modules(mon).values())
    alerted = [a for a in run.alerts if a.kind == "partial_coverage"]
    console = [str(w.message) for w in recwarn if "Per-example gradient norms leave out" in str(w.message)]
    if left_out:
        assert all(0.0 < c < 1.0 for c in coverage)
        partial = [v for _, v in run.scalars["gns/partial"]]
        assert partial == [float(c < mon.min_coverage) for c in coverage]
        # said once: a warning alert when the estimate is partial, else a console warning; and an alert when a later
        # check first finds it partial (the left-out share grew: HF GPT-2's position embeddings)
        said = [a.message for a in alerted] if partial[0] else console
        # each left-out module named, or counted in the message's "(n more modules)"
        more = re.search(r"\((\d+) more modules?\)", said[0]) if said else None
        named = [m for m in left_out if m in said[0]] if said else []
        assert len(said) == 1 and len(named) + (int(more.group(1)) if more else 0) == len(left_out)
        assert len(alerted) == int(any(partial)) and all(a.severity == "warning" for a in alerted)
        assert not alerted or alerted[0].step == run.scalars["gns/partial"][partial.index(1.0)][0]
    else:
        assert coverage == [1.0] * len(coverage) and not alerted and not console

    # causal LMs: GWA scores the labels shifted as the model's loss shifts them
    gwa = run.monitors["GradientWeightAlignment"]
    assert gwa._shift == (family in ("HF GPT-2", "HF Llama", "HF OPT"))
