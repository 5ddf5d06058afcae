"""What ``weftboard demo`` shows: a live terminal view, the summary table and the plot.

Pure presentation over plain data (``DemoStep``/``VersionRow`` lists); no I/O besides
writing the PNG, so the demo loop stays readable and this stays testable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

_BARS = "▁▂▃▄▅▆▇█"


@dataclass
class IslandRow:
    island_id: str
    version: int
    lag: int
    state: str
    served: int
    rejected: int


@dataclass
class DemoStep:
    step: int
    version: int
    reward: float
    rollouts: int
    used: int
    staleness_max: int
    seconds: float
    sample: str = ""


@dataclass
class VersionRow:
    version: int
    patch_bytes: int
    anchor_bytes: int
    density: float
    changed: int
    sync_s: dict[str, float] = field(default_factory=dict)  # island -> publish-to-applied seconds


def sparkline(values: Sequence[float], lo: float = 0.0, hi: float = 1.0) -> str:
    span = (hi - lo) or 1.0
    return "".join(_BARS[min(len(_BARS) - 1, max(0, int((v - lo) / span * (len(_BARS) - 1) + 0.5)))] for v in values)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def artifact_kind(v: VersionRow) -> str:
    if v.patch_bytes and v.anchor_bytes:
        return "patch+anchor"
    return "patch" if v.patch_bytes or not v.anchor_bytes else "anchor"


def artifact_text(v: VersionRow) -> str:
    if v.patch_bytes and v.anchor_bytes:
        return f"patch {human_bytes(v.patch_bytes)} (+ anchor {human_bytes(v.anchor_bytes)})"
    if v.anchor_bytes and not v.patch_bytes:
        return f"anchor {human_bytes(v.anchor_bytes)}"
    return f"patch {human_bytes(v.patch_bytes)}"


def render(head: int, steps: list[DemoStep], islands: list[IslandRow], versions: list[VersionRow],
           total_steps: int) -> Group:
    top = Table(title=f"weftboard demo — head v{head}, step {len(steps)}/{total_steps}", expand=False)
    top.add_column("island")
    top.add_column("version", justify="right")
    top.add_column("lag", justify="right")
    top.add_column("state")
    top.add_column("served", justify="right")
    top.add_column("409s", justify="right")
    for row in islands:
        style = "green" if row.lag == 0 and row.state == "ready" else "yellow"
        top.add_row(row.island_id, f"v{row.version}", str(row.lag), Text(row.state, style=style), str(row.served),
                    str(row.rejected))
    rewards = [s.reward for s in steps]
    lines = [Text(f"reward  {sparkline(rewards)}  last {rewards[-1]:.3f}" if rewards else "reward  (no step yet)")]
    if versions:
        last = versions[-1]
        lines.append(Text(f"v{last.version}: {artifact_text(last)}, density {last.density:.2%}"))
    if steps and steps[-1].sample:
        lines.append(Text(f"sample completion: {steps[-1].sample!r}"))
    return Group(top, *lines)


class DemoView:
    """A rich Live view on a terminal; one plain line per step otherwise."""

    def __init__(self, live: bool | None, total_steps: int, console: Console | None = None) -> None:
        self.console = console or Console()
        self.enabled = self.console.is_terminal if live is None else live
        self.total_steps = total_steps
        self._live: Live | None = None

    def __enter__(self) -> DemoView:
        if self.enabled:
            self._live = Live(console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def update(self, head: int, steps: list[DemoStep], islands: list[IslandRow], versions: list[VersionRow]) -> None:
        if self._live is not None:
            self._live.update(render(head, steps, islands, versions, self.total_steps))
        elif steps:
            s = steps[-1]
            fleet = " ".join(f"{i.island_id}=v{i.version}(lag {i.lag})" for i in islands)
            self.console.print(f"step {s.step:3d} head v{head} reward {s.reward:.3f} rollouts {s.used}/{s.rollouts} "
                               f"{fleet}", highlight=False)


def summary_table(steps: list[DemoStep], versions: list[VersionRow], islands: list[str]) -> Table:
    table = Table(title="weftboard demo — per version")
    for col in ("version", "artifact", "patch or anchor bytes", "density", *[f"sync {i} (ms)" for i in islands], "reward"):
        table.add_column(col, justify="right")
    reward_at = {s.version: s.reward for s in steps}
    for v in versions:
        kind = artifact_kind(v)
        size = v.patch_bytes or v.anchor_bytes
        syncs = [f"{v.sync_s[i] * 1000:.0f}" if i in v.sync_s else "-" for i in islands]
        reward = reward_at.get(v.version)
        table.add_row(str(v.version), kind, human_bytes(size), f"{v.density:.2%}", *syncs,
                      "-" if reward is None else f"{reward:.3f}")
    return table


def plot(steps: list[DemoStep], versions: list[VersionRow], islands: list[str], path: Path) -> Path:
    """Patch size, density and sync latency per version, and the reward per step, as one PNG."""
    import matplotlib  # optional dependency (the "plots" extra): only the demo's plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the Agg backend (no display)

    fig, axes = plt.subplots(4, 1, figsize=(9, 12), sharex=False)
    xs = [v.version for v in versions]
    patch_kib = [v.patch_bytes / 1024 for v in versions]
    anchor_kib = [v.anchor_bytes / 1024 for v in versions]
    axes[0].bar(xs, patch_kib, label="patch", color="tab:blue")
    axes[0].bar(xs, [a if not p else 0 for a, p in zip(anchor_kib, patch_kib, strict=True)], label="anchor only", color="tab:gray")
    axes[0].set_ylabel("KiB")
    axes[0].set_title("patch size per version")
    axes[0].legend()
    axes[1].plot(xs, [v.density * 100 for v in versions], marker="o")
    axes[1].set_ylabel("% of elements")
    axes[1].set_title("patch density (changed served elements)")
    for island in islands:
        pts = [(v.version, v.sync_s[island] * 1000) for v in versions if island in v.sync_s]
        if pts:
            axes[2].plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=island)
    axes[2].set_ylabel("ms")
    axes[2].set_title("sync latency: publish call to verified-and-activated on the island")
    axes[2].legend()
    axes[3].plot([s.step for s in steps], [s.reward for s in steps], marker="o", color="tab:green")
    axes[3].set_xlabel("optimizer step")
    axes[3].set_ylabel("mean reward")
    axes[3].set_title("reward of the rollouts each step trained on")
    for ax in axes[:3]:
        ax.set_xlabel("version")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
