"""Loss and validation τ against step, as a PNG in the run folder (matplotlib, no display).

Drawn with the Figure API, never pyplot: charts are drawn in Prefect task threads, and pyplot's
figure registry is process-wide and not thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence


def plot_training_curves(records: Sequence[dict], path: str, best_step: int | None = None) -> str:
    """records: the trainer's metrics lines (``loss`` each; ``val_tau`` where validated)."""
    from matplotlib.figure import Figure

    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_tau" in r]
    fig = Figure(figsize=(7, 5.5), dpi=100)
    ax_loss, ax_tau = fig.subplots(2, 1, sharex=True)
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], color="tab:blue")
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title("Training loss and validation acceptance")
    ax_tau.plot(
        [r["step"] for r in val],
        [r["val_tau"] for r in val],
        marker="o",
        color="tab:green",
        label="validation τ (teacher-forced)",
    )
    if best_step is not None:
        best = [r for r in val if r["step"] == best_step]
        if best:
            ax_tau.scatter(
                [best_step],
                [best[-1]["val_tau"]],
                s=120,
                facecolors="none",
                edgecolors="tab:red",
                label=f"best, exported (step {best_step})",
                zorder=3,
            )
    ax_tau.set_xlabel("step")
    ax_tau.set_ylabel("validation τ")
    if val:
        ax_tau.legend(loc="lower right")
    else:
        ax_tau.text(0.5, 0.5, "no validation split", ha="center", va="center", transform=ax_tau.transAxes)
    fig.tight_layout()
    fig.savefig(path)
    return path
