"""GradES validity: wall-clock saving and quality of GradientEarlyStopping on Hugging Face fine-tuning
settings we did not tune it on.

For every setting (a Hugging Face model class with a tiny random-init config):

1. pre-train briefly on one generated task (the weights are cached in the temp dir, keyed by a hash of
   the setting's config, so a rerun skips it);
2. fine-tune on a different generated task for a fixed step budget, same seed and data, without and
   with :class:`~lightning_monitor.GradientEarlyStopping` (defaults, or ``--grades-kwargs``), in
   interleaved repetitions (baseline, GradES, baseline, GradES, ...), single-threaded, validation
   outside the timed region;
3. report steps run, wall-clock and process CPU time of ``fit`` (median of the repetitions) and
   their ratios, held-out validation loss and task accuracy and their change against the baseline,
   what froze when, whether the run stopped early, and the per-step CPU time after the last freeze
   against before the first (the saving of freezing alone, apart from the early stop); and, outside
   Lightning, the CPU time of forward, backward and optimizer step with no component and with every
   component frozen (what freezing can save at most per step).

Target (issue): >= 1.5x wall-clock at <= 1% quality change on at least 2 of the 3 settings; quality
counts as kept when the validation loss is at most 1% above the baseline's and the task accuracy at
most 1 point below it.

Run: ``/work/venv/bin/python benchmarks/grades_validity.py`` (``--quick`` for a smoke run,
``--settings llama-rev,gpt2-sort``, ``--reps 3``, ``--grades-kwargs '{"tau": 0.3}'``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_monitor import GradientEarlyStopping  # noqa: E402
from lightning_monitor.functional.grades import find_components  # noqa: E402

PAD, SEP = 0, 1  # special tokens; data tokens are 2 .. vocab-1
FIRST = 2
IGNORE = -100


# ----------------------------------------------------------------------------- generated tasks


def _tokens(g: torch.Generator, n: int, length: int, vocab: int) -> Tensor:
    return torch.randint(FIRST, vocab, (n, length), generator=g)


def _seq2seq(x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """``x SEP y`` with the loss on ``y`` only (HF causal LMs shift the labels themselves)."""
    sep = torch.full((x.shape[0], 1), SEP)
    ids = torch.cat([x, sep, y], 1)
    labels = ids.clone()
    labels[:, : x.shape[1] + 1] = IGNORE
    return {"input_ids": ids, "labels": labels}


def lm_copy(g: torch.Generator, n: int, length: int, vocab: int) -> dict[str, Tensor]:
    x = _tokens(g, n, length, vocab)
    return _seq2seq(x, x)


def lm_reverse(g: torch.Generator, n: int, length: int, vocab: int) -> dict[str, Tensor]:
    x = _tokens(g, n, length, vocab)
    return _seq2seq(x, x.flip(1))


def lm_sort(g: torch.Generator, n: int, length: int, vocab: int) -> dict[str, Tensor]:
    x = _tokens(g, n, length, vocab)
    return _seq2seq(x, x.sort(1).values)


def lm_increment(g: torch.Generator, n: int, length: int, vocab: int) -> dict[str, Tensor]:
    x = _tokens(g, n, length, vocab)
    return _seq2seq(x, FIRST + (x - FIRST + 1) % (vocab - FIRST))


TASKS: dict[str, Callable[[torch.Generator, int, int, int], dict[str, Tensor]]] = {
    "copy": lm_copy, "reverse": lm_reverse, "sort": lm_sort, "increment": lm_increment,
}


# ----------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Setting:
    """One fine-tuning setting: the model class and size, the pre-training and fine-tuning tasks."""

    name: str
    family: str  # "llama", "gpt2", "qwen2"
    pretrain_task: str
    task: str
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    intermediate: int = 256
    vocab: int = 64
    length: int = 12  # data tokens per example (per half for the seq2seq tasks)
    batch: int = 32
    pretrain_steps: int = 300
    pretrain_lr: float = 3e-3
    steps: int = 600
    lr: float = 1e-3
    extra: dict[str, Any] = field(default_factory=dict)

    def key(self) -> str:
        spec = {k: v for k, v in asdict(self).items() if k not in ("name", "steps", "lr")}
        return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]


SETTINGS: dict[str, Setting] = {
    s.name: s for s in (
        Setting("llama-rev", "llama", "copy", "reverse"),
        Setting("gpt2-sort", "gpt2", "copy", "sort"),
        Setting("qwen2-inc", "qwen2", "copy", "increment", extra={"kv_heads": 2}),
    )
}


def build(s: Setting) -> nn.Module:
    """The Hugging Face causal LM of a setting, random-init."""
    import transformers

    positions = 2 * s.length + 2
    if s.family == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
            num_attention_heads=s.heads, num_key_value_heads=s.heads, max_position_embeddings=positions,
            bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD, tie_word_embeddings=False,
        )
        return transformers.LlamaForCausalLM(cfg)
    if s.family == "qwen2":
        cfg = transformers.Qwen2Config(
            vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
            num_attention_heads=s.heads, num_key_value_heads=s.extra.get("kv_heads", s.heads),
            max_position_embeddings=positions, bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD,
            tie_word_embeddings=False,
        )
        return transformers.Qwen2ForCausalLM(cfg)
    if s.family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=s.vocab, n_positions=positions, n_embd=s.hidden, n_layer=s.layers, n_head=s.heads,
            n_inner=s.intermediate, bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        return transformers.GPT2LMHeadModel(cfg)
    raise ValueError(s.family)


def make_data(s: Setting, task: str, n: int, seed: int) -> dict[str, Tensor]:
    return TASKS[task](torch.Generator().manual_seed(seed), n, s.length, s.vocab)


def make_loader(data: dict[str, Tensor], batch: int) -> DataLoader:
    return DataLoader(TensorDataset(data["input_ids"], data["labels"]), batch_size=batch, shuffle=False)


class HFModule(pl.LightningModule):
    def __init__(self, model: nn.Module, lr: float) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        ids, labels = batch
        return self.model(input_ids=ids, labels=labels).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


class StepTimer(pl.Callback):
    """Wall and CPU time of every training batch (forward, backward, optimizer step, callbacks)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._t0 = self._c0 = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.wall.append(time.perf_counter() - self._t0)
        self.cpu.append(time.process_time() - self._c0)


def _trainer(steps: int, callbacks: list, root: str) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", max_steps=steps, max_epochs=-1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, default_root_dir=root,
        num_sanity_val_steps=0,
    )


def pretrain(s: Setting, root: str) -> dict[str, Tensor]:
    path = Path(tempfile.gettempdir()) / f"lm_grades_validity_{s.family}_{s.key()}.pt"
    if path.exists():
        print(f"{s.name}: pre-trained weights {path} (cached)")
        return torch.load(path)
    pl.seed_everything(0, verbose=False)
    module = HFModule(build(s), s.pretrain_lr)
    data = make_data(s, s.pretrain_task, s.pretrain_steps * s.batch, seed=0)
    t0 = time.perf_counter()
    _trainer(s.pretrain_steps, [], root).fit(module, make_loader(data, s.batch))
    print(f"{s.name}: pre-trained {s.pretrain_steps} steps on {s.pretrain_task} in {time.perf_counter() - t0:.0f} s "
          f"-> {path}")
    state = module.model.state_dict()
    torch.save(state, path)
    return state


def load_pretrained(s: Setting, state: dict[str, Tensor]) -> nn.Module:
    model = build(s)
    model.load_state_dict(state)
    return model


@torch.no_grad()
def evaluate(model: nn.Module, s: Setting, val: dict[str, Tensor]) -> tuple[float, float]:
    """Held-out loss on the answer tokens and task accuracy (answer tokens predicted right under
    teacher forcing)."""
    model.eval()
    losses, hits, total = [], 0, 0
    for i in range(0, val["input_ids"].shape[0], 128):
        ids, labels = val["input_ids"][i: i + 128], val["labels"][i: i + 128]
        out = model(input_ids=ids, labels=labels)
        losses.append(float(out.loss) * ids.shape[0])
        pred, target = out.logits[:, :-1].argmax(-1), labels[:, 1:]
        m = target != IGNORE
        hits += int((pred[m] == target[m]).sum())
        total += int(m.sum())
    model.train()
    return sum(losses) / val["input_ids"].shape[0], hits / max(total, 1)


def step_profile(s: Setting, state: dict[str, Tensor], reps: int = 20) -> dict[str, dict[str, float]]:
    """Median CPU ms of forward, backward and AdamW step outside Lightning, on fine-tuning batches, with
    no component frozen (``"none"``) and with every component GradES watches frozen (``"all"``: the
    per-step cost once everything froze), the two interleaved step by step."""
    runs = {}
    for which in ("none", "all"):
        model = load_pretrained(s, state)
        if which == "all":
            for comp in find_components(model).values():
                for p in comp.params:
                    p.requires_grad_(False)
        runs[which] = (model, torch.optim.AdamW(model.parameters(), lr=s.lr))
    data = make_data(s, s.task, (reps + 2) * s.batch, seed=7)
    times: dict[str, dict[str, list[float]]] = {w: {"forward": [], "backward": [], "optimizer": []} for w in runs}
    for i in range(reps + 2):
        ids, labels = data["input_ids"][i * s.batch: (i + 1) * s.batch], data["labels"][i * s.batch: (i + 1) * s.batch]
        for which, (model, opt) in runs.items():
            c0 = time.process_time()
            loss = model(input_ids=ids, labels=labels).loss
            c1 = time.process_time()
            loss.backward()
            c2 = time.process_time()
            opt.step()
            opt.zero_grad()
            c3 = time.process_time()
            if i >= 2:
                times[which]["forward"].append(c1 - c0)
                times[which]["backward"].append(c2 - c1)
                times[which]["optimizer"].append(c3 - c2)
    return {w: {k: 1000 * statistics.median(v) for k, v in t.items()} for w, t in times.items()}


def finetune(
    s: Setting, state: dict[str, Tensor], train: dict[str, Tensor], val: dict[str, Tensor], root: str,
    grades: Optional[GradientEarlyStopping], seed: int = 1,
) -> dict[str, Any]:
    pl.seed_everything(seed, verbose=False)
    module = HFModule(load_pretrained(s, state), s.lr)
    timer = StepTimer()
    trainer = _trainer(s.steps, [timer] + ([grades] if grades is not None else []), root)
    loader = make_loader(train, s.batch)
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.fit(module, loader)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    loss, acc = evaluate(module.model, s, val)
    frozen = dict(grades.frozen) if grades is not None else {}
    n = len(grades.components) if grades is not None else 0
    # per-step CPU time by the frozen fraction in force during the step (step i runs after the freezes at
    # checks < i; a freeze at step k takes effect from the backward of step k + 1)
    before, after = [], []  # no component frozen yet / the final frozen set in force
    for step, ct in list(enumerate(timer.cpu))[3:]:  # the first steps warm up allocators
        k = sum(1 for f in frozen.values() if f < step)
        if k == 0:
            before.append(ct)
        elif k == len(frozen):
            after.append(ct)
    return {
        "wall": wall, "cpu": cpu, "steps": trainer.global_step, "val_loss": loss, "val_acc": acc, "frozen": frozen,
        "n_components": n, "stopped_at": grades.stopped_at if grades is not None else None,
        "step_cpu_before": 1000 * statistics.median(before) if before else float("nan"),
        "step_cpu_after": 1000 * statistics.median(after) if after else float("nan"),
        "steps_after": len(after), "median_cpu_ms": 1000 * statistics.median(timer.cpu[3:]),
    }


def run_setting(s: Setting, reps: int, grades_kwargs: dict[str, Any], root: str) -> dict[str, Any]:
    state = pretrain(s, root)
    train = make_data(s, s.task, s.steps * s.batch, seed=1)
    val = make_data(s, s.task, 1024, seed=100)
    profile = step_profile(s, state)
    base_runs, grades_runs = [], []
    for r in range(reps):
        base_runs.append(finetune(s, state, train, val, root, None))
        grades_runs.append(finetune(s, state, train, val, root, GradientEarlyStopping(**grades_kwargs)))
        b, g = base_runs[-1], grades_runs[-1]
        print(f"  {s.name} rep {r + 1}/{reps}: baseline {b['steps']} steps {b['wall']:.1f} s wall {b['cpu']:.1f} s CPU, "
              f"val {b['val_loss']:.4f}; GradES {g['steps']} steps {g['wall']:.1f} s wall {g['cpu']:.1f} s CPU, "
              f"val {g['val_loss']:.4f}, frozen {len(g['frozen'])}/{g['n_components']}", flush=True)
    params = sum(p.numel() for p in load_pretrained(s, state).parameters())
    return {"setting": s, "profile": profile, "base": base_runs, "grades": grades_runs, "params": params}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    med = statistics.median
    base, grades = res["base"], res["grades"]
    b, g = base[-1], grades[-1]  # quality and freezes: the same in every repetition (checked below)
    wall_ratio = med(x["wall"] for x in base) / med(x["wall"] for x in grades)
    cpu_ratio = med(x["cpu"] for x in base) / med(x["cpu"] for x in grades)
    d_loss = g["val_loss"] / b["val_loss"] - 1
    d_acc = g["val_acc"] - b["val_acc"]
    steps = sorted(g["frozen"].values())
    p = res["profile"]
    return {
        "name": res["setting"].name, "params": res["params"], "wall_ratio": wall_ratio, "cpu_ratio": cpu_ratio, "d_loss": d_loss, "d_acc": d_acc,
        "b": b, "g": g, "first": steps[0] if steps else None, "last": steps[-1] if steps else None,
        "step_ratio": med(x["step_cpu_after"] for x in grades) / med(x["step_cpu_before"] for x in grades),
        "steps_after": g["steps_after"],
        "b_wall": med(x["wall"] for x in base), "g_wall": med(x["wall"] for x in grades),
        "b_cpu": med(x["cpu"] for x in base), "g_cpu": med(x["cpu"] for x in grades),
        "bwd_share": p["none"]["backward"] / sum(p["none"].values()), "profile": p,
        "all_frozen_ratio": sum(p["all"].values()) / sum(p["none"].values()),
        "meets": wall_ratio >= 1.5 and d_loss <= 0.01 and d_acc >= -0.01,
        "same": len({(x["val_loss"], x["val_acc"]) for x in base}) == 1
        and len({(x["val_loss"], x["val_acc"], x["steps"]) for x in grades}) == 1,
        "pair_wall": [x["wall"] / y["wall"] for x, y in zip(base, grades)],
    }


def report(results: list[dict[str, Any]], reps: int, grades_kwargs: dict[str, Any]) -> None:
    rows = [summarize(r) for r in results]
    print(f"\nGradientEarlyStopping({', '.join(f'{k}={v!r}' for k, v in grades_kwargs.items())}) vs full fine-tuning, "
          f"same budget, seed and data; {reps} interleaved repetitions, times are medians, 1 torch thread\n")
    print("| setting | model (pre-train -> fine-tune) | budget | GradES steps | wall base / GradES (s) | wall ratio "
          "| CPU base / GradES (s) | CPU ratio | val loss base / GradES | loss change | accuracy base / GradES "
          "| froze (count, first-last step) | stopped early | CPU/step after the last freeze vs before the first | target |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s: Setting = next(x["setting"] for x in results if x["setting"].name == r["name"])
        b, g = r["b"], r["g"]
        froze = (f"{len(g['frozen'])}/{g['n_components']}, {r['first']}-{r['last']}" if g["frozen"]
                 else f"0/{g['n_components']}")
        stopped = f"yes, step {g['stopped_at']}" if g["stopped_at"] is not None else "no"
        step_ratio = (f"{r['step_ratio']:.2f}x ({len(g['frozen'])}/{g['n_components']} frozen, {r['steps_after']} steps)"
                      if r["steps_after"] else "n/a (nothing froze)" if not g["frozen"] else "n/a (no step after it)")
        print(f"| {r['name']} | {MODEL_NAMES[s.family]} {s.layers}x{s.hidden} ({s.pretrain_task} -> {s.task}) | "
              f"{s.steps} | {g['steps']} | {r['b_wall']:.1f} / {r['g_wall']:.1f} | {r['wall_ratio']:.2f}x | "
              f"{r['b_cpu']:.1f} / {r['g_cpu']:.1f} | {r['cpu_ratio']:.2f}x | {b['val_loss']:.4f} / {g['val_loss']:.4f} | "
              f"{100 * r['d_loss']:+.1f}% | {100 * b['val_acc']:.1f}% / {100 * g['val_acc']:.1f}% | {froze} | {stopped} "
              f"| {step_ratio} | {verdict(r)} |")
    print("\n| setting | components | parameters | forward / backward / AdamW CPU ms per step, nothing frozen | backward "
          "share | the same, all components frozen | step cost all frozen vs none | per-pair wall ratios "
          "| repetitions identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p, q = r["profile"]["none"], r["profile"]["all"]
        print(f"| {r['name']} | {r['g']['n_components']} | {r['params'] / 1e6:.2f} M | {p['forward']:.1f} / "
              f"{p['backward']:.1f} / {p['optimizer']:.1f} | {100 * r['bwd_share']:.0f}% | {q['forward']:.1f} / "
              f"{q['backward']:.1f} / {q['optimizer']:.1f} | {r['all_frozen_ratio']:.2f}x | "
              f"{', '.join(f'{x:.2f}' for x in r['pair_wall'])} | {r['same']} |")
    for res in results:
        g = res["grades"][-1]
        order = sorted(g["frozen"].items(), key=lambda kv: kv[1])
        if order:
            print(f"\n{res['setting'].name}: freeze steps "
                  f"{sorted(set(v for _, v in order))}; first frozen {order[0][0]} (step {order[0][1]}), "
                  f"last {order[-1][0]} (step {order[-1][1]})")
    n_met = sum(r["meets"] for r in rows)
    print(f"\ntarget (>= 1.5x wall-clock, val loss <= +1%, accuracy >= -1 point): met on {n_met} of {len(rows)} "
          f"settings ({', '.join(r['name'] for r in rows if r['meets']) or 'none'}); the issue asks for 2 of 3")


def verdict(r: dict[str, Any]) -> str:
    if r["meets"]:
        return "met"
    why = []
    if r["wall_ratio"] < 1.5:
        why.append(f"wall {r['wall_ratio']:.2f}x < 1.5x")
    if r["d_loss"] > 0.01:
        why.append(f"loss {100 * r['d_loss']:+.1f}%")
    if r["d_acc"] < -0.01:
        why.append(f"accuracy {100 * r['d_acc']:+.1f} pt")
    return "not met: " + ", ".join(why)


MODEL_NAMES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "qwen2": "Qwen2ForCausalLM"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models and few steps (smoke run, < 1 minute)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, from {list(SETTINGS)}")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions of each pair of runs")
    parser.add_argument("--steps", type=int, default=None, help="fine-tuning step budget (default per setting)")
    parser.add_argument("--grades-kwargs", default="{}", help="JSON object of GradientEarlyStopping arguments")
    args = parser.parse_args()
    grades_kwargs = json.loads(args.grades_kwargs)
    GradientEarlyStopping(**grades_kwargs)  # fail on a bad argument before any training
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {list(SETTINGS)}")
    settings = [SETTINGS[n] for n in names]
    if args.quick:
        settings = [replace(s, layers=2, hidden=32, intermediate=64, heads=2, length=6, batch=8, pretrain_steps=60,
                            steps=300, lr=3e-3, extra={}) for s in settings]
        args.reps = 1
    if args.steps is not None:
        settings = [replace(s, steps=args.steps) for s in settings]
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_monitor", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    root = tempfile.mkdtemp(prefix="grades_validity_")
    t0 = time.perf_counter()
    results = [run_setting(s, args.reps, grades_kwargs, root) for s in settings]
    report(results, args.reps, grades_kwargs)
    print(f"\ntotal wall-clock {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
