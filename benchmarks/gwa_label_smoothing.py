"""GWA on a loss with label smoothing: a tiny random-init Hugging Face ViT (2 layers, hidden 32, 10 classes) trained
with ``cross_entropy(..., label_smoothing=0.1)`` on generated images, GWA attached from the first step (its check of
the head's gradient runs at the random init, where the softmax is nearly uniform). The last epoch runs at lr 0, so its
GWA mean can be compared with the exact mean: the cosines of the real per-sample head gradients (taken in a backward
over the same batches) with the head's weights. Prints one JSON line.

Run: python benchmarks/gwa_label_smoothing.py [LOGDIR]   (about 30 s)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import transformers
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientWeightAlignmentMonitor, read_alerts

EPOCHS = 6


class SmoothedViT(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.vit = transformers.ViTForImageClassification(transformers.ViTConfig(
            image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.vit(pixel_values=x).logits

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1], label_smoothing=0.1)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == EPOCHS - 1:  # the weights stay: the epoch's scores are of one set of weights
            for group in self.trainer.optimizers[0].param_groups:
                group["lr"] = 0.0

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def exact_mean(module: SmoothedViT, loader: DataLoader) -> tuple[float, int]:
    """Mean and count of negatives of cos(-g_i z_i^T, W) over the samples, g_i the head output's real gradient."""
    head, seen, ref = module.vit.classifier, {}, []

    def hook(mod, args, out):
        seen.update(z=args[0].detach(), wz=(out - mod.bias).detach())
        out.register_hook(lambda grad: seen.update(g=grad.detach()))

    handle = head.register_forward_hook(hook)
    for batch in loader:
        module.zero_grad()
        module.training_step(batch, 0).backward()
        g, z, wz = seen["g"].double(), seen["z"].double(), seen["wz"].double()
        ref.append(-(g * wz).sum(-1) / (g.norm(dim=-1) * z.norm(dim=-1) * head.weight.detach().double().norm()))
    handle.remove()
    scores = torch.cat(ref)
    return float(scores.mean()), int((scores < 0).sum())


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    proto = torch.randn(10, 3, 16, 16, generator=g)
    y = torch.randint(0, 10, (512,), generator=g)
    x = proto[y] + 0.8 * torch.randn(512, 3, 16, 16, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=False)
    module = SmoothedViT()
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False)
    logger = CSVLogger(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(), name="vit")
    pl.Trainer(accelerator="cpu", max_epochs=EPOCHS, logger=logger, callbacks=[gwa], enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False).fit(module, loader)
    mean, negative = exact_mean(module, loader)
    last = gwa.history[-1]
    said = [(a.kind, a.value) for a in read_alerts(os.path.join(logger.log_dir, "alerts.jsonl"))
            if a.kind in ("logit_transform", "label_smoothing", "inexact_scores")]
    print(json.dumps({"gwa_mean": last["mean"], "exact_mean": mean, "gwa_negative": last["negative"],
                      "exact_negative": negative, "count": last["count"], "alerts": said}))


if __name__ == "__main__":
    main()
