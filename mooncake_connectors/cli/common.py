"""What every part of the command line shares: the Typer apps, logging, JSON output, the
option types."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated

import typer

from ..config import DEFAULT_TRANSPORTS

if TYPE_CHECKING:
    from ..tls import TlsConfig

app = typer.Typer(
    name="mooncake-connectors",
    help="Mooncake's KV-cache transfer engine, store and scheduler as engine plugins.",
    no_args_is_help=True,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks (JSON on stdout).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
certs_app = typer.Typer(help="Development certificates for TLS.", no_args_is_help=True)
app.add_typer(certs_app, name="certs")


def setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    import rich.table  # noqa: F401  # see below
    from rich.logging import RichHandler

    # RichHandler imports rich.table at its first record: a listener whose first warning is
    # "accept failed: EMFILE" would get an OSError from the import, out of its accept loop

    logging.basicConfig(
        level=level,
        format="%(name)s: %(message)s",
        handlers=[RichHandler(console=None, show_path=False, rich_tracebacks=False)],
    )


@contextlib.contextmanager
def progress_bar(what: str) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr (stdout carries the JSON result)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress(
        f"[bold]{what}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(what, total=None)

        def advance(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield advance


def emit(result: object, output: str | None) -> None:
    """Print ``result`` as JSON on stdout, and also write it to ``output`` when given."""
    text = json.dumps(result, indent=2)
    if output:
        with open(output, "w") as fh:
            fh.write(text + "\n")
    typer.echo(text)


Verbose = Annotated[int, typer.Option("--verbose", "-v", count=True, help="-v info, -vv debug")]
Output = Annotated[str | None, typer.Option("--output", "-o", help="Also write JSON here.")]
WorkDir = Annotated[str | None, typer.Option(help="Keep the model and the engine logs here.")]
Lengths = Annotated[str, typer.Option(help="Comma-separated prompt lengths in tokens.")]
TlsCert = Annotated[
    str | None,
    typer.Option(
        help="PEM certificate: listen and connect over TLS [MOONCAKE_CONNECTORS_TLS_CERT]."
    ),
]
TlsKey = Annotated[
    str | None, typer.Option(help="PEM key of --tls-cert [MOONCAKE_CONNECTORS_TLS_KEY].")
]
TlsCa = Annotated[
    str | None,
    typer.Option(
        help="PEM CA: peers must present a certificate it signed, which stands in for the "
        "token (mutual TLS) [MOONCAKE_CONNECTORS_TLS_CA]."
    ),
]
Rounds = Annotated[int, typer.Option(min=1, max=100, help="Prompts per length.")]
MaxTokens = Annotated[int, typer.Option(min=1, help="Tokens generated per request.")]
Layers = Annotated[int, typer.Option(min=1, help="Layers of the locally built model.")]
KvHeads = Annotated[int, typer.Option(min=1, help="KV heads of the locally built model.")]
DEFAULT_TRANSPORT_LIST = ",".join(DEFAULT_TRANSPORTS)
OurTransports = Annotated[
    str, typer.Option(help="Our connector's transports, in preference order.")
]


def tls_files(cert: str | None, key: str | None, ca: str | None) -> TlsConfig | None:
    """The TLS files from the flags, else the environment (None: TLS off)."""
    from ..config import tls_from_env
    from ..errors import ConfigError

    try:
        return tls_from_env(cert, key, ca)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--tls-cert/--tls-key/--tls-ca") from exc


@certs_app.command("init")
def certs_init(
    directory: Annotated[str, typer.Argument(help="Where to write ca.pem and NODE.pem/.key.")],
    nodes: Annotated[str, typer.Option(help="Comma-separated node names.")] = "node",
) -> None:
    """Make a development CA (reused if DIR has one) and a certificate per node."""
    from .. import certs

    paths = certs.init(directory, tuple(split_csv(nodes)))
    typer.echo(json.dumps({name: str(p) for name, p in paths.items()}))


def split_csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def split_urls(values: list[str]) -> list[str]:
    return [u.strip() for arg in values for u in arg.split(",") if u.strip()]


def serve_until_stopped() -> None:
    """Block until Ctrl-C or SIGTERM (a foreground service's main thread)."""
    import signal
    import threading

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with contextlib.suppress(KeyboardInterrupt):
        while not done.wait(1.0):
            pass
