"""``weftboard demo`` end to end, a few steps: real redis-server, board, publisher, two islands."""

from __future__ import annotations

import io
import json
import math

from rich.console import Console

from weftboard.subscriber.demo.rl_loop import DemoConfig, reward_of, run_demo


def test_reward_counts_the_pattern():
    assert reward_of("abababab", 8) == 1.0
    assert reward_of("", 8) == 0.0
    assert math.isclose(reward_of("bababab", 8), 7 * 0.2 / 8)  # right letters, wrong places: partial credit
    assert reward_of("ab", 8) == 2 / 8  # stopping early earns nothing for the missing positions


async def test_demo_runs_a_real_loop(tmp_path):
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=False)
    result = await run_demo(DemoConfig(steps=4, rollouts=8, out=tmp_path / "demo", live=False, late_join_step=2),
                            console=console)
    text = out.getvalue()
    # what it started is printed, and the plot path
    assert "redis-server" in text and "board (gRPC)" in text and str(result.plot_path) in text
    assert result.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every step trained on rollouts that came back through the board, with a reward
    assert [s.step for s in result.steps] == [1, 2, 3, 4]
    assert all(s.used > 0 and not math.isnan(s.reward) for s in result.steps)
    assert all(s.staleness_max <= 1 for s in result.steps)
    # both islands (one joined late) end on the head, bitwise equal to the trainer's served view
    assert result.head == 5  # version 1 at start + one per step
    assert result.islands == {"island-a": 5, "island-b": 5}
    assert result.bitwise == {"island-a": True, "island-b": True} and result.ok
    versions = [v.version for v in result.versions]
    assert versions == [1, 2, 3, 4, 5]
    assert result.versions[0].anchor_bytes > 0
    assert all("island-a" in v.sync_s for v in result.versions)
    summary = json.loads(result.summary_path.read_text())
    assert summary["bitwise"] == result.bitwise and len(summary["steps"]) == 4


def test_live_view_and_summary_render():
    from weftboard.subscriber.demo.view import (
        DemoStep,
        DemoView,
        IslandRow,
        VersionRow,
        render,
        summary_table,
    )

    steps = [DemoStep(1, 1, 0.1, 8, 8, 0, 0.5, "abab"), DemoStep(2, 2, 0.6, 8, 7, 1, 0.4, "abab")]
    islands = [IslandRow("island-a", 3, 0, "ready", 10, 0), IslandRow("island-b", 1, 2, "catching up", 0, 1)]
    versions = [VersionRow(1, 0, 1000, 1.0, 50, {"island-a": 0.2}), VersionRow(2, 300, 0, 0.05, 3, {})]
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=False)
    console.print(render(3, steps, islands, versions, total_steps=5))
    console.print(summary_table(steps, versions, ["island-a", "island-b"]))
    text = out.getvalue()
    assert "head v3" in text and "island-b" in text and "catching up" in text
    assert "300 B" in text and "5.00%" in text and "200" in text  # patch size, density, sync ms
    plain = io.StringIO()
    view = DemoView(False, 5, Console(file=plain, width=200))
    with view:
        view.update(3, steps, islands, versions)
    assert "step   2 head v3 reward 0.600" in plain.getvalue()
