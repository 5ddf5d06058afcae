"""CLI: ``weftboard demo``, a complete small RL loop on one machine (see ``rl_loop``). The loop
is imported when the command runs (the command line loads no torch, see ``board/cli.py``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer
from rich.console import Console


def register(app: typer.Typer, _bench: typer.Typer) -> None:  # no bench command here
    @app.command()
    def demo(
        steps: int = typer.Option(30, help="Optimizer steps (each publishes a version)."),
        out: Path = typer.Option(Path("weftboard-demo"), help="Directory for the plot, summary and data."),
        seed: int = typer.Option(0, help="Seed of the model and the rollouts."),
        s3: bool = typer.Option(False, "--s3", help="Use a bundled SeaweedFS S3 server instead of a local blob dir."),
        rollouts: int = typer.Option(16, help="Rollouts per step."),
        live: bool | None = typer.Option(None, "--live/--no-live", help="Live terminal view (default: on a terminal)."),
    ) -> None:
        """A complete small RL loop: trainer, board, two islands (one joins late), trajectories back."""
        # imported when the command runs: the command line loads no torch (board/cli.py)
        from weftboard.subscriber.demo.rl_loop import DemoConfig, run_demo

        console = Console()
        if not console.is_terminal:  # logs and CI: wide enough for the summary table
            console = Console(width=120)
        result = asyncio.run(run_demo(DemoConfig(steps=steps, out=out, seed=seed, s3=s3, rollouts=rollouts,
                                                 live=live), console=console))
        raise typer.Exit(0 if result.ok else 1)
