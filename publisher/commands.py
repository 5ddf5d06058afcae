"""``weftboard bench sync`` (delta sync vs full checkpoints, islands on this machine),
``weftboard bench publish`` (sharded publishing vs a gather to rank 0) and ``weftboard bench
chaos`` (the whole system under seeded faults, its history checked).

Only what the flags need is imported here (``board/cli.py``: the command line loads no torch);
each command imports its benchmark when it runs."""

from __future__ import annotations

from pathlib import Path

import typer

from weftboard.board.logs import configure
from weftboard.publisher.bench.wan.bench import WAN_LOSS
from weftboard.publisher.bench.wan.window import check_loss


def register(_app: typer.Typer, bench: typer.Typer) -> None:  # a bench command only
    @bench.command("sync")
    def bench_sync(
        params: int = typer.Option(110_000_000, help="Model parameters (fp32 master, bf16 served)."),
        islands: int = typer.Option(3, help="Island daemons (child processes)."),
        versions: int = typer.Option(5, help="Measured patch versions (after the initial anchor)."),
        destination: str = typer.Option("memory", help="Island destination: memory (live tensors) or dir (checkpoint)."),
        json_out: bool = typer.Option(False, "--json", help="Only the JSON line on stdout."),
        work_dir: Path | None = typer.Option(None, help="Where servers and islands keep their files."),
        warm_steps: int = typer.Option(30, help="AdamW steps before the first publish (Adam past its first steps)."),
        wan: bool = typer.Option(False, "--wan", help="Islands in network namespaces behind simulated WAN links (root + iproute2; skipped otherwise)."),
        wan_rate_mbit: float = typer.Option(100.0, help="--wan: link rate per island, each direction (tbf)."),
        wan_rtt_ms: float = typer.Option(40.0, help="--wan: round-trip time per island (delaying relay)."),
        wan_slow_start: bool = typer.Option(True, "--wan-slow-start/--wan-no-slow-start",
                                            help="--wan: TCP slow start over the simulated round trip (restarts after idle)."),
        wan_loss: float = typer.Option(WAN_LOSS, help="--wan: a segment's chance of being lost, each direction (late by a "
                                                      "round trip, the window cut; needs --wan-slow-start)."),
        trainer_gc: str = typer.Option("manual", help="The trainer's garbage collection: manual (off, gc.collect(1) every 10 "
                                                      "steps, as large trainers run) or auto (Python's default)."),
        encoding: str = typer.Option("default", help="The publisher's patch encoding: default, compact (fewer bytes, slower), context or baseline."),
        part_bytes: int | None = typer.Option(None, help="Streams per staged patch part (0: one patch blob, "
                                                            "nothing staged before the commit; default: the "
                                                            "publisher's own size (SUGGESTED_PART_BYTES, a few hundred "
                                                            "kB) while an island asks for parts (its blob store is "
                                                            "far), else one blob)."),
        board_process: bool = typer.Option(False, "--board-process/--board-in-process",
                                           help="Run the board as its own process, as deployed, or on the bench's "
                                                "event loop (sharing the trainer's and publisher's interpreter)."),
        presigned: bool = typer.Option(False, "--presigned", help="Islands without S3 credentials: every blob through "
                                                                  "the board's presigned URLs."),
    ) -> None:
        """Publish-to-applied on every island for patches vs full checkpoints; last line JSON."""
        # imported when the command runs: the command line loads no torch (board/cli.py)
        from weftboard.cuda.codec import ENCODINGS
        from weftboard.publisher.bench.bench_sync import main_cli  # (as above)

        if encoding not in ENCODINGS:
            raise typer.BadParameter(f"choose one of {', '.join(ENCODINGS)}", param_hint="--encoding")
        if part_bytes is not None and part_bytes < 0:
            raise typer.BadParameter("must be >= 0", param_hint="--part-bytes")
        try:
            check_loss(wan_loss, wan_slow_start)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--wan-loss") from None

        configure(json=True, level="WARNING")
        main_cli(params, islands, versions, destination, json_out, work_dir,
                 wan=wan, wan_rate_mbit=wan_rate_mbit, wan_rtt_ms=wan_rtt_ms, wan_slow_start=wan_slow_start,
                 wan_loss=wan_loss, warm_steps=warm_steps, trainer_gc=trainer_gc, encoding=encoding, part_bytes=part_bytes,
                 board_process=board_process, presigned=presigned)

    @bench.command("publish")
    def bench_publish_cmd(
        ranks: int = typer.Option(4, help="Ranks of the gloo job (processes on this machine)."),
        params: int = typer.Option(100_000_000, help="Model parameters at least (a stack of square linear layers)."),
        width: int = typer.Option(2048, help="Width of each linear layer."),
        versions: int = typer.Option(2, help="Measured patch versions (after the first, which anchors)."),
        json_out: bool = typer.Option(False, "--json", help="Only the JSON line on stdout."),
        work_dir: Path | None = typer.Option(None, help="Where Redis, the blob store and the ranks keep their files."),
        timeout_s: float = typer.Option(600.0, help="How long one version may take on one rank."),
    ) -> None:
        """Per-rank blocking time and bytes of sharded publishing vs gather-to-rank-0; last line JSON."""
        if ranks < 1 or versions < 1:
            raise typer.BadParameter("--ranks and --versions must be >= 1")
        # imported when the command runs: the command line loads no torch (board/cli.py)
        from weftboard.publisher.bench import bench_publish

        configure(json=True, level="WARNING")
        bench_publish.main_cli(ranks, params, width, versions, json_out, work_dir, timeout_s)

    @bench.command("chaos")
    def bench_chaos(
        duration: float = typer.Option(300.0, help="Seconds of faults (3600: the soak, memory and descriptor growth)."),
        seed: int | None = typer.Option(None, help="Replays a fault schedule (default: a random seed, printed)."),
        json_out: bool = typer.Option(False, "--json", help="Only the JSON line on stdout."),
        islands: int = typer.Option(3, help="Islands (an engine process and a sidecar each)."),
        appendfsync: str = typer.Option("everysec", help="Redis AOF fsync policy: everysec or always."),
        publish_interval_s: float = typer.Option(0.25, help="Least time between two versions (0: back to back)."),
        work_dir: Path | None = typer.Option(None, help="Where processes keep data and logs (kept afterwards)."),
        keep: bool = typer.Option(False, help="Keep the temporary work dir (it is kept anyway when a check fails)."),
    ) -> None:
        """The whole system under a seeded schedule of kills, network faults, a full disk and corrupt
        blobs, then its history checked (nothing lost, no torn or wrong version); last line JSON."""
        if appendfsync not in ("everysec", "always"):
            raise typer.BadParameter("everysec or always", param_hint="--appendfsync")
        if duration <= 0 or islands < 1:
            raise typer.BadParameter("--duration and --islands must be positive")
        # imported when the command runs: the command line loads no torch (board/cli.py)
        from weftboard.publisher.bench.chaos import bench as chaos_bench

        configure(json=True, level="WARNING")
        shape = chaos_bench.SystemShape(islands=islands, appendfsync=appendfsync, publish_interval_s=publish_interval_s)
        params = chaos_bench.ChaosParams(duration_s=duration, seed=seed, shape=shape, work_dir=work_dir, keep=keep)
        raise typer.Exit(chaos_bench.main_cli(params, json_out))
