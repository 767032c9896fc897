"""How precise can a list of suspected flipped labels be on the GWA validity settings, by any detector?

``gwa_validity.py`` scores GWA's suspects (``gwa_suspects_run.csv``) by precision at k = the number of flipped
labels. This script ranks the same training samples (same data, split and flipped labels, 20% noise) by other
detectors, each lowest first by a score of the *given* label:

* ``svm_clean``: an RBF SVM (Platt probabilities) cross-fitted on the clean labels of the whole data set (5 folds;
  each training sample is scored by a model that never saw it): an oracle, it sees clean labels;
* ``net_clean``: the setting's own network and optimizer (the model GWA watches), cross-fitted on clean labels the
  same way, 10 epochs: what this architecture can tell apart when no label is wrong;
* ``noisy_em``: no oracle. Class-conditional Gaussian mixtures fitted by EM with the flip model (a flipped label
  goes to any other class alike, at the known rate), on the training inputs and their given labels only; a
  sample's score is the posterior of its given label with that label left out.

``--monitor F``: the JSON of ``gwa_validity.py --noise 0.2 --json F`` (same seeds) adds the monitor's own list.

Run: python benchmarks/gwa_suspects_ceiling.py [--seeds 6] [--monitor F]   (one thread, about 5 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gwa_validity as gv  # noqa: E402

NOISE = 0.2
#: mixture components per class and covariance regularisation of the EM detector, per dataset
EM_SETUP = {"cls20": (2, 1e-3), "cls20hard": (2, 1e-3), "moons": (8, 1e-3), "cancer": (1, 0.3), "digits": (1, 0.05)}


def precision(score: np.ndarray, flipped: np.ndarray) -> float:
    k = int(flipped.sum())
    return float(flipped[np.argsort(score, kind="stable")[:k]].sum()) / k


def train_net(setting: str, x: np.ndarray, y: np.ndarray, x_eval: np.ndarray, n_cls: int, seed: int,
              epochs: int = 10) -> np.ndarray:
    """The benchmark's network and optimizer for ``setting`` (batch 64), trained on ``(x, y)``; softmax on ``x_eval``."""
    import torch
    from torch import nn

    cfg = gv.SETTINGS[setting]
    torch.manual_seed(seed)
    if cfg["model"] == "cnn":
        net = nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                            nn.Linear(32 * 16, 128), nn.ReLU(), nn.Linear(128, n_cls))
    else:
        net = nn.Sequential(nn.Linear(x.shape[1], 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                            nn.Linear(256, n_cls))
    opt = (torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4) if cfg["opt"] == "sgd"
           else torch.optim.Adam(net.parameters(), lr=1e-3))
    xs, ys = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.int64)
    for _ in range(epochs):
        for rows in torch.randperm(len(xs)).split(64):
            loss = nn.functional.cross_entropy(net(xs[rows]), ys[rows])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        return net(torch.as_tensor(x_eval, dtype=torch.float32)).softmax(-1).double().numpy()


def cross_fitted(setting: str, x: np.ndarray, y: np.ndarray, rows: np.ndarray, n_cls: int, seed: int,
                 folds: int = 5) -> dict[str, np.ndarray]:
    """Each training row's class probabilities from models fitted on the other folds (clean labels)."""
    from sklearn.svm import SVC

    fold = np.random.default_rng(999 + seed).permutation(len(y)) % folds
    where = np.full(len(y), -1)
    where[rows] = np.arange(len(rows))
    out = {name: np.zeros((len(rows), n_cls)) for name in ("svm_clean", "net_clean")}
    for f in range(folds):
        fit = np.flatnonzero(fold != f)
        ev = np.flatnonzero((fold == f) & (where >= 0))
        svm = SVC(C=3.0, gamma="scale", probability=True, random_state=0).fit(x[fit], y[fit])
        out["svm_clean"][where[ev]] = svm.predict_proba(x[ev])
        out["net_clean"][where[ev]] = train_net(setting, x[fit], y[fit], x[ev], n_cls, 10 * seed + f)
    return out


def _log_normal(x: np.ndarray, mu: np.ndarray, cov: np.ndarray) -> np.ndarray:
    chol = np.linalg.cholesky(cov)
    z = np.linalg.solve(chol, (x - mu).T)
    return -0.5 * (z ** 2).sum(0) - np.log(np.diag(chol)).sum() - 0.5 * x.shape[1] * np.log(2 * np.pi)


def noisy_em(x: np.ndarray, given: np.ndarray, n_cls: int, rate: float, per_class: int, reg: float,
             seed: int, iters: int = 60) -> np.ndarray:
    """p(true class | x) from class-conditional Gaussian mixtures fitted to ``(x, given)`` with the flip model."""
    from sklearn.mixture import GaussianMixture

    flip = np.full((n_cls, n_cls), rate / (n_cls - 1))
    np.fill_diagonal(flip, 1 - rate)
    parts = [GaussianMixture(per_class, covariance_type="full", reg_covar=reg, random_state=seed).fit(x[given == c])
             for c in range(n_cls)]
    mus = np.concatenate([p.means_ for p in parts])
    covs = np.concatenate([p.covariances_ for p in parts])
    weights = np.concatenate([p.weights_ / n_cls for p in parts])
    owner = np.repeat(np.arange(n_cls), per_class)

    def log_density() -> np.ndarray:
        return np.stack([_log_normal(x, mus[j], covs[j]) + np.log(weights[j] + 1e-300) for j in range(len(owner))], 1)

    for _ in range(iters):
        joint = log_density() + np.log(flip[owner][:, given].T)
        joint -= joint.max(1, keepdims=True)
        resp = np.exp(joint)
        resp /= resp.sum(1, keepdims=True)
        mass = resp.sum(0) + 1e-9
        weights = mass / len(x)
        mus = (resp.T @ x) / mass[:, None]
        for j in range(len(owner)):
            d = x - mus[j]
            covs[j] = (resp[:, j, None] * d).T @ d / mass[j] + reg * np.eye(x.shape[1])
    dens = log_density()
    dens = np.exp(dens - dens.max(1, keepdims=True))
    post = np.zeros((len(x), n_cls))
    np.add.at(post.T, owner, dens.T)
    return post / post.sum(1, keepdims=True)


def run(setting: str, seed: int) -> dict[str, float]:
    data = gv.split(gv.SETTINGS[setting]["data"], seed, NOISE)
    x_all, y_all, rows = data["all"]
    given, flipped, n_cls = data["train"][1].numpy(), data["flipped"], data["n_cls"]
    pick = np.arange(len(rows))
    out = {name: precision(p[pick, given], flipped)
           for name, p in cross_fitted(setting, x_all, y_all, rows, n_cls, seed).items()}
    per_class, reg = EM_SETUP[gv.SETTINGS[setting]["data"]]
    post = noisy_em(x_all[rows].astype(np.float64), given, n_cls, NOISE, per_class, reg, seed)
    out["noisy_em"] = precision(post[pick, given], flipped)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--settings", nargs="+", default=list(gv.SETTINGS))
    parser.add_argument("--monitor", help="JSON of gwa_validity.py --noise 0.2 --json F")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    table: dict[str, dict[str, list[float]]] = {s: {} for s in args.settings}
    if args.monitor:
        for r in json.load(open(args.monitor)):
            if r["flip"] == NOISE and r["setting"] in table and r["seed"] < args.seeds:
                table[r["setting"]].setdefault("monitor", []).append(r["precision_run"])
    for seed in range(args.seeds):
        for setting in args.settings:
            for name, value in run(setting, seed).items():
                table[setting].setdefault(name, []).append(value)
            print(f"seed {seed} {setting}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in table[setting].items()
                                                         if k != "monitor"), flush=True)
    names = [n for n in ("monitor", "net_clean", "svm_clean", "noisy_em") if any(n in t for t in table.values())]
    print(f"\nSuspects precision at k = number flipped, {int(100 * NOISE)}% noise, seeds 0-{args.seeds - 1} (median)\n")
    print("| setting | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for setting, cols in table.items():
        print(f"| {setting} | " + " | ".join(f"{statistics.median(cols[n]):.3f}" if n in cols else "-" for n in names)
              + " |")
    pooled = [f"{statistics.median([v for t in table.values() for v in t.get(n, [])]):.3f}" for n in names]
    print(f"| median of all runs | " + " | ".join(pooled) + " |")


if __name__ == "__main__":
    main()
