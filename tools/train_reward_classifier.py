"""Train a small image success classifier for :class:`envs.wrappers.RewardClassifierReward`.

Labelled frames come from either

* recorded episodes (``--episodes DIR``: ``episode_*.npz`` written by
  :class:`envs.wrappers.EpisodeRecorder`): a frame is positive when its ``success`` flag is
  set, and with ``--positive-last K`` also the last K frames of every successful episode;
  everything else is negative;
* image folders (``--images DIR``): ``DIR/<camera>/success/*.png`` and
  ``DIR/<camera>/failure/*.png`` with matching file names across cameras (one camera:
  ``DIR/success/*.png`` and ``DIR/failure/*.png``).

The model (per camera: conv layers + ReLU + global average pooling; a linear head on the
concatenated features) is trained with torch here and saved as a ``.npz`` that
``envs/`` runs with numpy (:class:`envs.wrappers.RewardClassifier`). The decision
threshold saved with it is the one that maximises balanced accuracy on the validation split.

    python -m tools.train_reward_classifier --episodes runs/recordings --cameras front wrist \\
        --out runs/reward_classifier.npz

Then use it in an env config: ``reward_classifier: {path: runs/reward_classifier.npz}``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path

import numpy as np

from data.core.schema import OBS_IMAGE_PREFIX
from envs.wrappers import RewardClassifier, load_episode, resize_image

DEFAULT_CONVS = [[16, 5, 2], [32, 3, 2], [32, 3, 2], [64, 3, 1]]


def load_episode_frames(folder: str, cameras: list[str], positive_last: int = 0,
                        skip_last_record: bool = True) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Frames and 0/1 labels from EpisodeRecorder files."""
    paths = sorted(glob.glob(os.path.join(folder, "episode_*.npz")))
    if not paths:
        raise FileNotFoundError(f"no episode_*.npz in {folder}")
    imgs: dict[str, list[np.ndarray]] = {c: [] for c in cameras}
    labels: list[np.ndarray] = []
    for p in paths:
        arrays, meta = load_episode(p)
        n = len(arrays["success"])
        y = arrays["success"].astype(np.float32).copy()
        if positive_last and meta.get("success"):
            y[max(0, n - positive_last):] = 1.0
        for c in cameras:
            key = OBS_IMAGE_PREFIX + c
            if key not in arrays:
                raise KeyError(f"{p} has no camera {c!r} (has {[k for k in arrays if k.startswith(OBS_IMAGE_PREFIX)]})")
            imgs[c].append(arrays[key])
        labels.append(y)
    return {c: np.concatenate(v) for c, v in imgs.items()}, np.concatenate(labels)


def load_image_folders(folder: str, cameras: list[str]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    from PIL import Image

    def read(paths):
        return np.stack([np.asarray(Image.open(p).convert("RGB")) for p in paths]) if paths else None

    root = Path(folder)
    single = len(cameras) == 1 and (root / "success").is_dir()
    imgs: dict[str, list[np.ndarray]] = {c: [] for c in cameras}
    labels = []
    for label, name in ((1.0, "success"), (0.0, "failure")):
        base = root / name if single else root / cameras[0] / name
        names = sorted(p.name for p in base.glob("*.png"))
        for c in cameras:
            d = root / name if single else root / c / name
            arr = read([d / n for n in names])
            if arr is not None:
                imgs[c].append(arr)
        labels.append(np.full(len(names), label, np.float32))
    return {c: np.concatenate(v) for c, v in imgs.items()}, np.concatenate(labels)


def build_torch_model(n_cams: int, convs: list[list[int]]):
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.towers = nn.ModuleList()
            for _ in range(n_cams):
                layers, c_in = [], 3
                for out, k, s in convs:
                    layers += [nn.Conv2d(c_in, out, k, s), nn.ReLU()]
                    c_in = out
                self.towers.append(nn.Sequential(*layers))
            self.head = nn.Linear(convs[-1][0] * n_cams, 1)

        def forward(self, xs):  # xs: list of [N, 3, S, S] float in [0, 1]
            f = torch.cat([t(x).mean(dim=(2, 3)) for t, x in zip(self.towers, xs, strict=True)], dim=1)
            return self.head(f).squeeze(1)

    return Net()


def export(net, cameras: list[str], input_size: int, convs, threshold: float) -> RewardClassifier:
    params: dict[str, np.ndarray] = {}
    for ci, tower in enumerate(net.towers):
        convs_t = [m for m in tower if m.__class__.__name__ == "Conv2d"]
        for li, conv in enumerate(convs_t):
            params[f"cam{ci}.conv{li}.weight"] = conv.weight.detach().cpu().numpy()
            params[f"cam{ci}.conv{li}.bias"] = conv.bias.detach().cpu().numpy()
    params["head.weight"] = net.head.weight.detach().cpu().numpy()
    params["head.bias"] = net.head.bias.detach().cpu().numpy()
    return RewardClassifier(cameras, input_size, convs, params, threshold)


def best_threshold(p: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Threshold maximising balanced accuracy, and that accuracy."""
    best = (0.5, -1.0)
    for t in np.unique(np.concatenate([p, [0.5]])):
        pred = p >= t
        pos, neg = y > 0.5, y <= 0.5
        tpr = pred[pos].mean() if pos.any() else 1.0
        tnr = (~pred[neg]).mean() if neg.any() else 1.0
        bal = 0.5 * (tpr + tnr)
        if bal > best[1]:
            best = (float(t), float(bal))
    return best


def train(images: dict[str, np.ndarray], labels: np.ndarray, cameras: list[str], *, input_size: int = 64,
          convs=None, epochs: int = 20, batch_size: int = 64, lr: float = 1e-3, val_frac: float = 0.2,
          seed: int = 0, augment: bool = True, log=print) -> tuple[RewardClassifier, dict]:
    import torch

    convs = convs or DEFAULT_CONVS
    size = input_size
    for _out, k, s in convs:
        size = (size - k) // s + 1
        if size < 1:
            raise ValueError(f"input_size {input_size} is too small for conv layers {convs}")
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    n = len(labels)
    if n < 4 or labels.min() == labels.max():
        raise ValueError(f"need both positive and negative frames (got {int(labels.sum())} of {n} positive)")
    x = {c: np.stack([resize_image(im, input_size) for im in images[c]]) for c in cameras}
    order = rng.permutation(n)
    n_val = max(1, int(round(val_frac * n))) if val_frac > 0 else 0
    val, tr = order[:n_val], order[n_val:]
    net = build_torch_model(len(cameras), convs)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    pos_w = torch.tensor(max(1.0, (labels[tr] <= 0.5).sum() / max(1.0, (labels[tr] > 0.5).sum())))
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_w)

    def to_t(idx, aug):
        out = []
        for c in cameras:
            b = torch.from_numpy(x[c][idx]).permute(0, 3, 1, 2).float() / 255.0
            if aug:
                pad = max(1, input_size // 16)
                b = torch.nn.functional.pad(b, (pad, pad, pad, pad), mode="replicate")
                i, j = rng.integers(0, 2 * pad + 1, 2)
                b = b[:, :, i:i + input_size, j:j + input_size]
            out.append(b)
        return out

    def predict(idx):
        net.eval()
        with torch.no_grad():
            ps = [torch.sigmoid(net(to_t(idx[i:i + 256], False))).numpy() for i in range(0, len(idx), 256)]
        net.train()
        return np.concatenate(ps) if ps else np.zeros(0)

    for ep in range(epochs):
        perm = rng.permutation(tr)
        total = 0.0
        for i in range(0, len(perm), batch_size):
            idx = perm[i:i + batch_size]
            logits = net(to_t(idx, augment))
            loss = loss_fn(logits, torch.from_numpy(labels[idx]).float())
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        msg = f"epoch {ep + 1}/{epochs} loss {total / max(1, len(tr)):.4f}"
        if n_val:
            pv = predict(val)
            msg += f" val acc@0.5 {((pv >= 0.5) == (labels[val] > 0.5)).mean():.3f}"
        log(msg)
    eval_idx = val if n_val else tr
    p = predict(eval_idx)
    thr, bal = best_threshold(p, labels[eval_idx])
    model = export(net, cameras, input_size, convs, thr)
    metrics = {"n": int(n), "n_val": int(n_val), "positives": int((labels > 0.5).sum()),
               "threshold": thr, "balanced_accuracy": bal,
               "accuracy_at_threshold": float(((p >= thr) == (labels[eval_idx] > 0.5)).mean())}
    return model, metrics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.train_reward_classifier",
                                 description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--episodes", help="folder of EpisodeRecorder episode_*.npz files")
    src.add_argument("--images", help="folder of success/ and failure/ images")
    ap.add_argument("--cameras", nargs="+", required=True, help="camera names, e.g. front wrist")
    ap.add_argument("--positive-last", type=int, default=0,
                    help="also label the last K frames of successful episodes positive")
    ap.add_argument("--out", required=True, help="output .npz")
    ap.add_argument("--input-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--val-frac", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.episodes:
        images, labels = load_episode_frames(args.episodes, args.cameras, args.positive_last)
    else:
        images, labels = load_image_folders(args.images, args.cameras)
    print(f"{len(labels)} frames, {int(labels.sum())} positive", file=sys.stderr)
    model, metrics = train(images, labels, args.cameras, input_size=args.input_size, epochs=args.epochs,
                           batch_size=args.batch_size, lr=args.lr, val_frac=args.val_frac, seed=args.seed,
                           log=lambda m: print(m, file=sys.stderr))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    model.save(args.out)
    print(json.dumps({"out": args.out, **metrics}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
