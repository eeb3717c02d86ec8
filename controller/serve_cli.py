"""`deskfleet serve`: the OpenAI-compatible HTTP API over local stages or the fleet's deployed chain."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import ssl
import stat
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING

from deskfleet.common import event_loop
from deskfleet.common.arguments import line_of_text, path_argument, seconds_up_to
from deskfleet.common.console import stopping_signals
from deskfleet.common.open_files import log_open_files_limit, raise_open_files_limit
from deskfleet.common.stop_signal import StopSignal
from deskfleet.common.wire import ProtocolError, is_loopback_host, parse_address

from .chat import add_fleet_option, check_fleet_options, controller_store, fleet_max_failovers, open_fleet_chain
from .decoding_options import (
    DecodingOptions,
    add_drafting_options,
    add_prefill_option,
    compile_settings,
    non_negative_int,
    positive_int,
)
from .engine_service import TAKE_BACK_BUSY_S, ServiceClosed

if TYPE_CHECKING:
    from deskfleet.agent.stage import CompileSettings
    from deskfleet.common.model_spec import Manifest

    from .engine import ChainBroken, EngineOptions, Recover, StageChain
    from .engine_service import ChainOpener
    from .fleet_failover import FleetFailover, TakeBackLook
    from .openai_api import OpenAiApi

log = logging.getLogger(__name__)

DEFAULT_PORT = 8000
API_KEY_ENV = "DESKFLEET_API_KEY"
MAX_KEY_FILE_BYTES = 64 * 1024  # an --api-key-file past this is no key file (the key is its first line)
DEFAULT_MAX_STREAMS = 64
# Prompt tokens whose KV state a server keeps for later requests that share their prefix: with an 8B model's KV
# cache in u8 (64 KB a token over all its layers) 512 MB across the fleet's PCs
DEFAULT_PREFIX_CACHE_TOKENS = 8192
# A server's one run never ends: --max-failovers bounds the re-plans within this long of each other (a storm of
# failures), not over the server's life, after which the streams running would fail at the next PC that drops out
FAILOVER_WINDOW_S = 600.0
MAX_TAKE_BACK_WAIT_S = 86400.0  # --take-back-wait: past a day, say so rather than a typo's years


def add_serve_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
                      add_compile_options: Callable[[argparse.ArgumentParser], None]) -> None:
    serve = subparsers.add_parser(
        "serve", help="an OpenAI-compatible HTTP API (local stages or --fleet)",
        description="An OpenAI-compatible HTTP API: GET /v1/models, POST /v1/completions and /v1/chat/completions "
                    "(streamed with \"stream\": true), GET /health. Requests that arrive together run as concurrent "
                    "streams of one engine, batched. It runs in the foreground until Ctrl-C, SIGTERM or SIGHUP.")
    serve.add_argument("--model", type=path_argument, required=True, help="export folder (with its tokenizer)")
    add_fleet_option(serve)
    serve.add_argument("--stages", type=positive_int, default=None,
                       help="in-process pipeline stages (default 1; local only)")
    serve.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORT}", metavar="HOST:PORT",
                       help=f"where to listen (default 127.0.0.1:{DEFAULT_PORT}, this PC only; another address needs "
                            f"an API key, or --no-api-key)")
    serve.add_argument("--api-key-file", type=path_argument, default=None, metavar="FILE",
                       help=f"a file holding the API key clients must send as `Authorization: Bearer KEY` (default: "
                            f"${API_KEY_ENV}, else none)")
    serve.add_argument("--no-api-key", action="store_true",
                       help="serve without an API key on an address other than loopback: anyone who reaches the "
                            "port can use the model")
    serve.add_argument("--tls-cert", type=path_argument, default=None, metavar="FILE",
                       help="serve HTTPS with this PEM certificate (its chain after it), with --tls-key: the API key "
                            "and every prompt and reply cross the network encrypted")
    serve.add_argument("--tls-key", type=path_argument, default=None, metavar="FILE",
                       help="the certificate's private key (PEM, unencrypted, readable by this user only)")
    serve.add_argument("--model-name", default=None, type=model_name_argument,
                       help="the model's id, which clients give as `model` (default: the export folder's name)")
    serve.add_argument("--max-streams", type=positive_int, default=DEFAULT_MAX_STREAMS,
                       help="requests running or waiting at once; more are answered 429 (default "
                            f"{DEFAULT_MAX_STREAMS})")
    serve.add_argument("--max-rows", type=positive_int, default=8,
                       help="streams per micro-batch (default 8; more while requests wait: --rows-when-busy)")
    serve.add_argument("--rows-when-busy", type=positive_int, default=None, metavar="N",
                       help="a micro-batch's rows at most while more requests wait, from --max-rows to twice it "
                            "(default twice: every request prefilled goes on at once; --max-rows's value: they wait "
                            "for a row after their first token, holding less KV memory, as each row of a micro-batch "
                            "holds as many positions as its longest)")
    serve.add_argument("--prefix-cache-tokens", type=non_negative_int, default=DEFAULT_PREFIX_CACHE_TOKENS,
                       metavar="N",
                       help="prompt tokens whose KV state stays on the stages for later requests that begin with the "
                            "same tokens (a chat's next turn, a shared system prompt), which then feed only the rest; "
                            f"0: none kept (default {DEFAULT_PREFIX_CACHE_TOKENS})")
    serve.add_argument("--take-back-wait", type=seconds_up_to(MAX_TAKE_BACK_WAIT_S), default=None, metavar="SECONDS",
                       help="--fleet: a PC a re-plan left out that calls in again is taken back at the server's next "
                            "idle moment, or, where streams keep running this long, by moving them onto a chain that "
                            "takes it (each waits for the re-plan and is prefilled again, as after a failover); 0: at "
                            f"once (default {TAKE_BACK_BUSY_S:.0f})")
    add_drafting_options(serve)  # a request says how it samples
    add_prefill_option(serve)
    add_compile_options(serve)
    serve.set_defaults(handler=_serve_command, extras=("controller",), log_times=True)


def model_name_argument(text: str) -> str:
    """argparse type: a model id clients can give as `model`: line_of_text (empty, it fell back to the folder's name
    unsaid), with no space at either end."""
    line_of_text(text, "is empty (an unset variable?): give the id clients name the model by")
    if text != text.strip():
        raise argparse.ArgumentTypeError(f"{text!r:.60} has a space at an end: no client would name it so")
    return text


def read_api_key(path: Path | None, environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """The API key from `path` (its first line), else from $DESKFLEET_API_KEY; None where neither gives one.
    ValueError for a file that cannot be read, is empty, or others may read (the key would be theirs too)."""
    if path is None:
        key = environ.get(API_KEY_ENV, "").strip()
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:  # it failed later, saying only "'utf-8' codec can't encode character"
            raise ValueError(f"${API_KEY_ENV} holds bytes that are not UTF-8 text: give a key of text") from None
        return key or None
    _check_regular("--api-key-file", path)  # /dev/zero was read without end, a FIFO waited for ever
    _check_private("--api-key-file", path)  # before it is read: a key others may read is not taken
    try:
        with path.open("rb") as stream:
            text = stream.read(MAX_KEY_FILE_BYTES + 1).decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--api-key-file {path}: cannot be read: {error}") from None
    if len(text) > MAX_KEY_FILE_BYTES:
        raise ValueError(f"--api-key-file {path} holds more than {MAX_KEY_FILE_BYTES // 1024} KiB: no key is that "
                         "long (another file given by mistake?)")
    key = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not key:
        raise ValueError(f"--api-key-file {path} is empty: put the key on its first line")
    return key


def server_tls(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    """The TLS context `serve` listens with (TLS 1.2 at least), from --tls-cert and --tls-key; None for neither.
    ValueError naming the file and what is wrong: one of the two alone, a file that cannot be read, a key others may
    read, an encrypted key (a server started by systemd has nobody to type its passphrase), or a certificate and a
    key that do not belong together."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ValueError(f"{'--tls-cert' if key is None else '--tls-key'} without "
                         f"{'--tls-key' if key is None else '--tls-cert'}: HTTPS needs the certificate and its key")
    for option, path in (("--tls-cert", cert), ("--tls-key", key)):
        _check_regular(option, path)
        try:
            with path.open("rb"):
                pass
        except OSError as error:
            raise ValueError(f"{option} {path}: cannot be read: {error.strerror or error}") from None
    _check_private("--tls-key", key)

    def no_passphrase() -> str:
        raise ValueError(f"--tls-key {key} is encrypted: give the key unencrypted, readable by this user only "
                         f"(`(umask 077; openssl pkey -in {key} -out KEY)`)")

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key, password=no_passphrase)
    except ssl.SSLError as error:
        raise ValueError(f"--tls-cert {cert} and --tls-key {key}: {error.reason or error} (a PEM certificate, then "
                         "its chain, and the private key it was made for)") from None
    return context


def _check_regular(option: str, path: Path) -> None:
    """ValueError where `path` (or what its link names) is missing or no regular file: a device, a FIFO, a folder.
    `--api-key-file /dev/null` was told to `chmod 600 /dev/null` first, which as root breaks the system."""
    try:
        mode = path.stat().st_mode
    except OSError as error:
        raise ValueError(f"{option} {path}: cannot be read: {error.strerror or error}") from None
    if not stat.S_ISREG(mode):
        what = "a folder" if stat.S_ISDIR(mode) else "a device, a FIFO or a socket"
        raise ValueError(f"{option} {path} is {what}, not a file: give the file that holds it")


def _check_private(option: str, path: Path) -> None:
    """ValueError where others than this user may read `path` (POSIX): a secret they could read is theirs too."""
    mode = path.stat().st_mode
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{option} {path}: others can read it (mode {stat.S_IMODE(mode):o}): `chmod 600 {path}` first")


def _serve_command(args: argparse.Namespace) -> int:
    from deskfleet.common.model_spec import load_manifest

    from .chat_template import TemplateRenderer
    from .engine_service import EngineService
    from .openai_api import OpenAiApi
    from .tokenizer import ModelTokenizer

    check_fleet_options(args)
    if args.fleet:  # a model never deployed is the command's fault, exit 2 as generate --fleet's, before listening
        from .fleet_deploy import load_deployment

        load_deployment(controller_store(args.data_dir), args.model)
    if args.rows_when_busy is not None and not args.max_rows <= args.rows_when_busy <= 2 * args.max_rows:
        raise ValueError(f"--rows-when-busy must be from --max-rows ({args.max_rows}) to twice it "
                         f"({2 * args.max_rows}), got {args.rows_when_busy}: no more requests than that are "
                         "prefilled ahead")
    if args.take_back_wait is not None and not args.fleet:
        raise ValueError("--take-back-wait without --fleet: local stages have no PC to take back; give --fleet or "
                         "leave out --take-back-wait")
    try:
        host, port = parse_address(args.listen, any_port=True, default_port=DEFAULT_PORT)
    except ProtocolError as error:
        raise ValueError(f"--listen: {error}") from None
    api_key = read_api_key(args.api_key_file)
    if api_key is None and not is_loopback_host(host) and not args.no_api_key:
        raise ValueError(f"--listen {args.listen} reaches beyond this PC, and no API key is set: give --api-key-file "
                         f"(or ${API_KEY_ENV}), or --no-api-key to let anyone who reaches the port use the model")
    if api_key is not None and args.no_api_key:
        raise ValueError("--no-api-key with an API key given (--api-key-file or $DESKFLEET_API_KEY): leave one out")
    tls = server_tls(args.tls_cert, args.tls_key)
    if tls is None and not is_loopback_host(host):
        print(f"deskfleet: note: --listen {args.listen} serves plain HTTP: the API key and every prompt and reply "
              "cross the network readable by anyone on the way; give --tls-cert and --tls-key for HTTPS",
              file=sys.stderr)
    manifest = load_manifest(args.model)
    tokenizer = ModelTokenizer(args.model)
    decoding = DecodingOptions(draft=args.draft, prompt_lookup=args.prompt_lookup, k=args.k, k_max=args.k_max,
                               prefill_chunk=args.prefill_chunk, settings=compile_settings(args))
    target = decoding.target_settings()
    draft = decoding.open_drafter(target, args.model, over_fleet=args.fleet)
    stages = args.stages or 1

    def options_for(chain: StageChain) -> EngineOptions:
        return serve_engine_options(decoding, getattr(chain, "num_stages", stages), args)

    stop = StopSignal()  # set as the service closes: a fleet's re-plan or step under way gives up
    opener = _fleet_opener(args, decoding, stop) if args.fleet else _local_opener(args.model, stages, target, manifest)
    name = args.model_name
    if name is None:
        try:
            name = model_name_argument(args.model.resolve().name)
        except argparse.ArgumentTypeError as error:
            raise ValueError(f"the export folder's name, the model's id by default, {error}: give --model-name"
                             ) from None
    look = _take_back_look(args, stop) if args.fleet else None
    service = EngineService(opener, manifest.spec, draft, options_for, max_streams=args.max_streams, take_back=look,
                            take_back_busy_s=TAKE_BACK_BUSY_S if args.take_back_wait is None
                            else args.take_back_wait, take_back_while_busy=look.left_out_back if look else None,
                            stop=stop)
    # a keyless server on loopback answers its own names only (a web page could reach it through another)
    hosts = frozenset({"127.0.0.1", "localhost", "::1", host}) if api_key is None and is_loopback_host(host) else None
    try:
        with TemplateRenderer() as renderer:
            tokenizer.renderer = renderer
            api = OpenAiApi(service, tokenizer, manifest.spec, name, api_key, hosts)
            event_loop.run(_listen(api, host, port, "the fleet" if args.fleet else f"{stages} local stage(s)", tls))
    except ServiceClosed as error:  # the chain did not open
        print(f"deskfleet: error: {error}", file=sys.stderr)
        return 1
    finally:
        service.close()
    return 0


async def _listen(api: OpenAiApi, host: str, port: int, where: str, tls: ssl.SSLContext | None = None) -> None:
    """Listen first (a port in use is said before anything compiles), then open the chain, then serve until a
    stopping signal; then the streams running end with an error, which their clients get, and the server stops.
    `tls`: serve HTTPS with it (server_tls)."""
    from aiohttp import web

    log_open_files_limit(raise_open_files_limit())  # each client's connection takes one
    runner = api.runner()
    await runner.setup()
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    stopped_by: list[int] = []
    handled = []

    def stop(signum: int) -> None:
        stopped_by.append(signum)
        stopped.set()

    for signum in stopping_signals():
        try:
            loop.add_signal_handler(signum, stop, signum)
            handled.append(signum)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        try:
            await web.TCPSite(runner, host, port, ssl_context=tls).start()
        except OSError as error:
            raise ValueError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
        print(f"deskfleet: opening {api.model_name} ({where}) ...", file=sys.stderr, flush=True)
        starting = asyncio.ensure_future(asyncio.to_thread(api.service.start))
        waiting = asyncio.ensure_future(stopped.wait())
        await asyncio.wait([starting, waiting], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # stopped while the chain opens: a fleet's gives up at once (local stages compile on)
            print(f"deskfleet: stopped by {signal.Signals(stopped_by[0]).name} while the chain opened", file=sys.stderr,
                  flush=True)
            await asyncio.to_thread(api.service.close)
            with suppress(ServiceClosed):
                await starting
            return
        waiting.cancel()
        starting.result()  # ServiceClosed: the chain did not open
        bound = runner.addresses[0][1] if runner.addresses else port
        shown = f"[{host}]" if ":" in host else host
        key = "an API key" if api.has_api_key else "no API key"
        scheme = "http" if tls is None else "https"
        print(f"deskfleet: serving {api.model_name} at {scheme}://{shown}:{bound}/v1 ({key}); Ctrl-C stops",
              file=sys.stderr, flush=True)
        await stopped.wait()
        # said as its start was (a service manager's SIGTERM ended it without a word, exit 0)
        running = api.service.live_streams
        print(f"deskfleet: stopped by {signal.Signals(stopped_by[0]).name}"
              + (f"; {running} stream(s) running end with an error their clients get" if running else ""),
              file=sys.stderr, flush=True)
    finally:
        for signum in handled:
            loop.remove_signal_handler(signum)
        await asyncio.to_thread(api.service.close)  # the streams running end: their handlers answer and return
        await runner.cleanup()


def serve_engine_options(decoding: DecodingOptions, stages: int, args: argparse.Namespace) -> EngineOptions:
    """The engine's options for a chain of `stages`: requests prefilled ahead (as many again as the rows) join a
    running micro-batch past --max-rows, up to --rows-when-busy (default twice it), rather than wait for a row after
    their first token."""
    busy = 2 * args.max_rows if args.rows_when_busy is None else args.rows_when_busy
    return decoding.engine_options(stages, max_rows=args.max_rows, rows_when_waiting=busy,
                                   prefix_cache_tokens=args.prefix_cache_tokens)


def _local_opener(model: Path, stages: int, settings: CompileSettings, manifest: Manifest) -> ChainOpener:
    from .engine_service import OpenedChain
    from .pipeline import LocalPipeline

    @contextmanager
    def open_local() -> Iterator[OpenedChain]:
        with LocalPipeline(model, stages, settings, manifest) as pipeline:
            yield OpenedChain(pipeline)

    return open_local


def _fleet_opener(args: argparse.Namespace, decoding: DecodingOptions, stop: StopSignal) -> ChainOpener:
    from .engine_service import OpenedChain

    store = controller_store(args.data_dir)
    drafting = decoding.draft is not None or decoding.prompt_lookup

    @contextmanager
    def open_fleet() -> Iterator[OpenedChain]:
        with open_fleet_chain(store, args.model, fleet_max_failovers(args), args.discover_seconds,
                              drafting=drafting, stop=stop) as (chain, failover):
            # a PC back while streams run is taken back by the re-plan a run's start makes (the failover closes the
            # chains it made, those it replaced too)
            yield OpenedChain(chain, windowed(failover), lambda: failover.rejoin(running=True))

    return open_fleet


def _take_back_look(args: argparse.Namespace, stop: StopSignal) -> TakeBackLook:
    from .fleet_failover import TakeBackLook

    return TakeBackLook(controller_store(args.data_dir), args.model, stop)


def windowed(failover: FleetFailover, window_s: float = FAILOVER_WINDOW_S,
             clock: Callable[[], float] = time.monotonic) -> Recover:
    """`failover`, whose --max-failovers budget is whole again once `window_s` passed since its last re-plan (as a
    chat's next reply gets it whole: FleetFailover.start_run)."""
    last = [-math.inf]

    def recover(error: ChainBroken) -> StageChain:
        now = clock()
        if now - last[0] > window_s:
            failover.start_run()
        last[0] = now
        return failover(error)

    return recover
