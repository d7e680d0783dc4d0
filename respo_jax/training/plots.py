"""Training curves as PNG: researchers read curves, not logs."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from respo_jax.runs import atomic_write_bytes  # noqa: E402


def plot_training_curves(records: list[dict], path: str, title: str = "") -> str:
    """Training accuracy ((score+1)/2, paper §4.1), mean log W, response length, approximate KL (k1) and
    rollout-time entropy (the paper's Figs. 5-6) vs policy updates; panels for keys the records have.
    Written atomically to `path` (PNG)."""
    rl = [r for r in records if r.get("phase") == "rl"]
    if not rl:
        raise ValueError("no RL records to plot")
    x = [r["policy_updates"] for r in rl]
    panels = [("train_accuracy", "training accuracy"), ("log_w_mean", "mean log W"),
              ("response_length", "response length (tokens)"), ("approx_kl", "approx. KL (k1)"),
              ("entropy", "entropy (nats)")]
    panels = [(key, label) for key, label in panels if key in rl[0]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (key, label) in zip(list(axes) if len(panels) > 1 else [axes], panels):
        ax.plot(x, [r.get(key, float("nan")) for r in rl], lw=1.6)  # a gap: an iteration without it
        ax.set_xlabel("policy updates")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())  # a kill never leaves half a PNG
    return path
