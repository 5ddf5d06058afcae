"""``weftboard warmup``, and ``weftboard bench codec`` and ``bench formats`` (on the ``bench``
group): registered by weftboard.board.cli.

Only typer is imported here (the command line loads no torch, see ``board/cli.py``); each
command imports the codec or its benchmark when it runs."""

from __future__ import annotations

import json

import typer


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @app.command("warmup")
    def warmup(
        formats: list[str] = typer.Option(None, "--format",
                                          help="served format to warm (repeat for several; default: every format)"),
        encodings: list[str] = typer.Option(None, "--encoding",
                                            help="patch encoding to warm (repeat for several; default: every encoding)"),
    ) -> None:
        """Compile the CPU codec's kernels now (once per machine, image or cache directory) instead of
        in a trainer's first publish or an island's first apply; with a warm cache it only loads them."""
        # imported when the command runs: the command line loads no torch (board/cli.py)
        from weftboard.cuda import jit
        from weftboard.cuda import warmup as wu  # (as above)

        bad = sorted(set(formats or ()) - set(wu.ALL_FORMATS))
        if bad:
            raise typer.BadParameter(f"{', '.join(bad)}: choose from {', '.join(wu.ALL_FORMATS)}", param_hint="--format")
        bad = sorted(set(encodings or ()) - set(wu.ALL_ENCODINGS))
        if bad:
            raise typer.BadParameter(f"{', '.join(bad)}: choose from {', '.join(wu.ALL_ENCODINGS)}", param_hint="--encoding")
        typer.echo(f"kernel cache: {jit.kernel_cache_dir()} (NUMBA_CACHE_DIR moves it)")
        done = wu.warm_up_kernels(tuple(formats or wu.ALL_FORMATS), tuple(encodings or wu.ALL_ENCODINGS),
                                  say=lambda line: typer.echo(f"  {line}"))
        widths = "/".join(str(w) for w in done.widths)
        typer.echo(f"warm: {len(done.signatures)} kernel signatures compiled or loaded for {widths}-byte elements and "
                   f"the {', '.join(done.encodings)} encoding{'s' if len(done.encodings) > 1 else ''} "
                   f"in {done.seconds:.1f} s")

    @bench.command("codec")
    def bench_codec(
        format: str = typer.Option("bf16", "--format", help="served format: bf16, fp16, fp8, fp8_e5m2, mxfp4 or nvfp4"),
        params: int = typer.Option(55_000_000, "--params", help="approximate fp32 parameters of the test model"),
        repeat: int = typer.Option(5, "--repeat", min=1, help="timed rounds (each times every operation once); the best of each is reported"),
        adam_steps: int = typer.Option(1, "--adam-steps", min=1, help="measure the transition of this AdamW step (1: the first)"),
        encoding: str = typer.Option("default", "--encoding",
                                     help="encoding measured: default, compact (16-bit floats coded by old magnitude, "
                                          "per tensor the smaller stream) or context (the same classes, rANS values)"),
        as_json: bool = typer.Option(False, "--json", help="print the result as one JSON object on the last line"),
    ) -> None:
        """Patch size against the entropy bound and the int32+raw baseline, and CPU speed against a copy."""
        # imported when the command runs: the command line loads no torch (board/cli.py)
        from weftboard.cuda.bench import bench_codec as bc

        if format not in bc.FORMAT_KINDS:
            raise typer.BadParameter(f"choose one of {', '.join(bc.FORMAT_KINDS)}", param_hint="--format")
        if encoding not in ("default", "compact", "context"):
            raise typer.BadParameter("choose default, compact or context", param_hint="--encoding")
        bc.main(format, params, repeat, as_json, adam_steps, encoding)

    @bench.command("formats")
    def bench_formats(
        layers: int = typer.Option(2, "--layers", min=1),
        hidden: int = typer.Option(256, "--hidden", min=128, help="a multiple of 128"),
        steps: int = typer.Option(3, "--steps", min=1, help="AdamW steps (transitions measured)"),
        lr: float = typer.Option(3e-6, "--lr"),
        as_json: bool = typer.Option(False, "--json", help="print the rows as JSON on the last line"),
    ) -> None:
        """Patch density per scale policy (fixed, pow2) against recomputed scales, same steps."""
        # imported when the command runs: the command line loads no torch (board/cli.py)
        from weftboard.cuda.bench import formats_bench

        rows = formats_bench.run(layers=layers, hidden=hidden, intermediate=3 * hidden, steps=steps, lr=lr)
        if as_json:
            print(json.dumps(rows))
