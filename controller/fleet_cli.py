"""`deskfleet fleet ...`: the fleet's admin commands. Parsing, dispatch and printing only.

    fleet init [--name N] [--address HOST:PORT]...      make the fleet CA and the controller certificate
    fleet token [--ttl 24h] [--uses N]                   print a join token for `deskfleet-agent join`
    fleet remove AGENT                                   revoke an agent (id, id prefix of 4+ or hostname)
    fleet serve [--listen HOST:PORT]                     enrollment + registration endpoint (keep running)
    fleet ls                                             agents, states and stages
    fleet window                                         the same in a window, kept up to date
    fleet plan --model DIR | --layers N --layer-bytes B  the split, and why agents were left out
    fleet deploy --model DIR                             push what each agent lacks, assign the stages
    fleet generate --model DIR --prompt-ids 1,2,3        greedy tokens through the deployed chain
Every command takes --data-dir (default: $DESKFLEET_CONTROLLER_DIR, else the platform's data dir).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deskfleet.common import event_loop
from deskfleet.common.arguments import browse_seconds, line_of_text, path_argument, real_number, whole_number
from deskfleet.common.console import print_whole, stopping_signals
from deskfleet.common.devices import device_targets
from deskfleet.common.planner import PlanPolicy
from deskfleet.common.wire import (
    ProtocolError,
    is_loopback_address,
    parse_address,
    with_default_port,
)
from deskfleet.common.wire_messages import KV_CACHE_PRECISIONS
from deskfleet.controller.bench.interruption import say_stopped, signal_name, signals_unwind, stopping_signal
from deskfleet.controller.decoding_options import byte_count, parse_token_ids, positive_int
from deskfleet.controller.fleet_store import DEFAULT_PORT, MIN_ID_PREFIX, FleetStore
from deskfleet.controller.text_table import format_table

if TYPE_CHECKING:
    from deskfleet.controller.fleet_deploy import DeploySettings

_POLICIES = [policy.value for policy in PlanPolicy]
LONG_TOKEN_TTL = datetime.timedelta(days=7)  # `fleet token --ttl` past this is warned of
MANY_TOKEN_USES = 100  # `fleet token --uses` past this is warned of (a roll-out to a whole floor may want more)
PAPER_OPTIONS = ("layers", "layer_bytes", "embed_bytes", "head_bytes", "kv_bytes_per_token", "context", "width")
PAPER_CONTEXT = 4096
# A plan holds a few objects per layer: 10^8 layers (--layers and --layer-bytes swapped) filled the memory for
# minutes. The largest models have a few hundred.
MAX_PAPER_LAYERS = 10_000
DEFAULT_EVERY_S = 15.0  # `fleet window`: from one look at the fleet to the next
# a survey of a large office takes seconds (dials to PCs that are off wait 10 s): more often than this only queues;
# less often than an hour shows a fleet too old to act on
MIN_EVERY_S, MAX_EVERY_S = 2.0, 3600.0


# Public methods

def add_fleet_commands(subparsers: Any) -> None:
    """Add `fleet` and its subcommands to the controller's argparse subparsers."""
    fleet = subparsers.add_parser(
        "fleet", help="manage the fleet: trust, agents, plans, deployment",
        description="The office PCs that run a model together. The steps, once: `fleet init` (the fleet's CA, on "
                    "this PC), keep `fleet serve` running, `fleet token`, and on each PC `deskfleet-agent join -` (the "
                    "token on standard input) then `deskfleet-agent --headless` (the agent, in the foreground). Then "
                    "`fleet ls`, `fleet plan --model M`, `fleet deploy --model M`, and `deskfleet generate --fleet "
                    "--model M` or `deskfleet chat --fleet --model M`.")
    commands = fleet.add_subparsers(dest="fleet_command", required=True, metavar="FLEET_COMMAND")

    def command(name: str, help_text: str, details: str = "") -> argparse.ArgumentParser:
        description = f"{help_text[0].upper()}{help_text[1:]}." + (f" {details}" if details else "")
        parser: argparse.ArgumentParser = commands.add_parser(name, help=help_text, description=description)
        parser.add_argument("--data-dir", type=path_argument, default=None,
                            help="controller data dir (default: $DESKFLEET_CONTROLLER_DIR or the platform's)")
        return parser

    init = command("init", "create the fleet CA and this controller's certificate",
                   "Then keep `fleet serve` running, and make a token for each PC with `fleet token`.")
    init.add_argument("--name", default="deskfleet", type=_fleet_name_argument,
                      help="fleet name in the CA certificate (default: deskfleet)")
    init.add_argument("--address", action="append", default=None, metavar="HOST:PORT",
                      help="where agents reach this controller (repeatable; default: this PC's address, port "
                           "7341)")
    init.add_argument("--force", action="store_true", help="replace an existing fleet (every agent must rejoin)")
    init.set_defaults(handler=_init)

    token = command("token", "print a join token",
                    "A PC joins with it: `deskfleet-agent join -` there, the token on standard input. Whoever holds "
                    "it can join a PC while it lasts: keep it as a password. Joins need `fleet serve` running.")
    token.add_argument("--ttl", default="24h", help="validity: a number and s, m, h or d, or several (90s, 30m, "
                                                    "1h30m, 7d; default 24h)")
    token.add_argument("--uses", type=whole_number, default=1, help="how many agents may join with it (default 1)")
    token.add_argument("--address", action="append", default=None, metavar="HOST:PORT",
                       help="controller address(es) to put in the token (default: those given to init)")
    token.set_defaults(handler=_token)

    remove = command("remove", "remove an agent from the fleet (revokes its certificate)",
                     "For good: the PC can join again only as a new agent, with a new key (delete agent-key.pem in "
                     "the agent's state folder, then join with a new token).")
    remove.add_argument("agent", help=f"agent id, a unique prefix of it (at least {MIN_ID_PREFIX} characters), "
                                      "or its hostname")
    remove.set_defaults(handler=_remove)

    serve = command("serve", "run the enrollment and registration endpoint",
                    "It runs in the foreground until Ctrl-C, SIGTERM or SIGHUP; PCs join and agents register only "
                    "while it runs, and it announces the controller over mDNS unless it listens on loopback.")
    serve.add_argument("--listen", default=None, metavar="HOST:PORT",
                       help="where to listen (default: every interface, IPv4 and IPv6, at the port of the first init "
                            "address; a fleet whose init addresses are all loopback: the first of them)")
    serve.set_defaults(handler=_serve, log_times=True)  # it runs for days: each log line says when

    for name, help_text, handler in (("ls", "list agents, states and stages", _ls),
                                     ("plan", "show how a model would be split over the agents", _plan),
                                     ("deploy", "push a model's shards and assign its stages", _deploy),
                                     ("generate", "greedy token ids through the deployed chain (low level: for "
                                                  "text, sampling, drafting and chat, `deskfleet generate --fleet` "
                                                  "and `deskfleet chat --fleet`)", _generate)):
        parser = command(name, help_text)
        _add_survey_arguments(parser)
        parser.add_argument("--json", action="store_true", help="print JSON")
        parser.set_defaults(handler=handler)
        if name in ("plan", "deploy"):
            parser.add_argument("--policy", choices=_POLICIES, default=PlanPolicy.FEWEST_AGENTS.value,
                                help="fewest_agents (the default): the fewest PCs that hold the model, so one that "
                                     "holds it gets it all; all_by_speed: every PC whose share shortens the "
                                     "slowest stage by more than a hop costs (see --hop-ms; 0 uses every PC that "
                                     "helps at all)")
            parser.add_argument("--streams", type=positive_int, default=1,
                                help="streams whose KV to reserve (default 1)")
            parser.add_argument("--device", type=_device_name, default="CPU",
                                help="OpenVINO device on the agents: CPU, GPU, GPU.1, NPU, AUTO:GPU,CPU ...")
            parser.add_argument("--hop-ms", type=_hop_ms, default=None, metavar="MS",
                                help="what each stage's hop costs a token, under all_by_speed (default 1 ms, a LAN; "
                                     "over a WAN the hop's round trip)")
            # plan takes them too: the KV cache a plan reserves depends on them (f32 holds 4x what u8 does)
            parser.add_argument("--precision", choices=["device_default", "f16", "f32"], default="device_default",
                                help="how the agents compute: device_default (the default; on a CPU what generate's "
                                     "`fast` is: f32 arithmetic, int8 dynamic quantization, a u8 KV cache), f16, or "
                                     "f32 (exact, as generate's `f32`)")
            parser.add_argument("--kv-cache", choices=KV_CACHE_PRECISIONS, default=None,
                                help="the agents' KV cache precision (default: the precision's own; f32 makes "
                                     "verifying drafts cheaper on CPUs, at 4x the memory of u8)")
        if name in ("deploy", "generate"):
            parser.add_argument("--model", type=path_argument, required=True, help="export folder")
        if name == "generate":
            parser.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
            parser.add_argument("--max-new-tokens", "--new-tokens", dest="max_new_tokens", type=positive_int,
                                default=16, help="tokens to generate (default 16; --new-tokens too)")
            parser.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
        if name == "plan":
            _add_paper_model(parser)

    window = command("window", "a window that shows the fleet, kept up to date",
                     "What `fleet ls` prints, for the admin to keep open on the controller PC: every PC with its "
                     "state, CPU and iGPU load, temperature, power, free memory and stages, all a selected PC "
                     "reported, and the notes and warnings. It looks again every --every seconds (Refresh: now). "
                     "Its buttons run `fleet plan` and `fleet deploy` (Deploy a model), `fleet token` (Join token) "
                     "and `fleet remove` (Remove PC, once you say yes) as you would type them.")
    _add_survey_arguments(window)
    window.add_argument("--every", type=_every_seconds, default=DEFAULT_EVERY_S, metavar="SECONDS",
                        help=f"seconds from one look at the fleet to the next (default {DEFAULT_EVERY_S:g}; "
                             f"{MIN_EVERY_S:g} to {MAX_EVERY_S:g})")
    window.set_defaults(handler=_window)


def _add_survey_arguments(parser: argparse.ArgumentParser) -> None:
    """Where a command looks for agents beside those registered with `fleet serve`."""
    parser.add_argument("--peer", action="append", default=[], metavar="HOST:PORT", type=_peer_argument,
                        help="also dial this agent address (repeatable)")
    parser.add_argument("--discover-seconds", type=browse_seconds, default=2.0,
                        help="how long to browse mDNS for agents on the LAN (default 2; 0: no multicast, the "
                             "agents registered with `fleet serve` and --peer only)")


# Private methods: options

def _every_seconds(text: str) -> float:
    """argparse type: `fleet window --every`, MIN_EVERY_S to MAX_EVERY_S seconds."""
    try:
        value = real_number(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not MIN_EVERY_S <= value <= MAX_EVERY_S:  # NaN too
        raise argparse.ArgumentTypeError(f"must be from {MIN_EVERY_S:g} to {MAX_EVERY_S:g} seconds, got {text}")
    return value


def _hop_ms(text: str) -> float:
    """argparse type: milliseconds a hop costs, 0 to 60000 (NaN, infinity, negatives refused)."""
    try:
        value = real_number(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, got {text!r}") from None
    if not 0 <= value <= 60_000:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"must be 0 to 60000 ms, got {text}")
    return value


def _device_name(text: str) -> str:
    """argparse type: an OpenVINO device name, checked here: a typo was caught by the agents, after every shard
    had been sent."""
    try:
        device_targets(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


# Private methods: trust

def _fleet_name_argument(text: str) -> str:
    """argparse type of `fleet init --name`: one line of text (a line break went into the CA's name; bytes that are
    not UTF-8 failed naming no option); its length is the CA's to check (init_fleet)."""
    return line_of_text(text, "is empty or blank (an unset variable?): give the fleet's name")


def _peer_argument(text: str) -> str:
    """argparse type: an agent's address, host:port. Checked as the option is read: `fleet generate` dials its
    --peer only when a PC drops out mid-run, so a typo passed unsaid until then."""
    try:
        parse_address(text)
    except ProtocolError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _store(args: argparse.Namespace) -> FleetStore:
    from deskfleet.controller.fleet_store import check_data_dir, default_data_dir

    return FleetStore(check_data_dir(args.data_dir or default_data_dir()))


def _addresses(given: Sequence[str]) -> tuple[str, ...]:
    """--address values, each with the usual port where it names a host alone; one that is no address is refused
    as given (the error quoted it with the port added: 'bad address:7341')."""
    import ipaddress

    from deskfleet.common.wire import ProtocolError, parse_address

    for text in given:
        try:
            host, _ = parse_address(text, default_port=DEFAULT_PORT)
        except ProtocolError as error:
            raise ValueError(f"--address: {error}") from None
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:  # a host name
            continue
        if ip.is_unspecified or ip.is_multicast or ip.is_reserved:  # taken, and put in every token, before
            raise ValueError(f"--address {text}: {host} is no address a PC can reach the controller at (an "
                             "unspecified, multicast or reserved address): give this PC's LAN address or host name "
                             "(`fleet serve` listens on every interface by default)")
        if ip.version == 6 and ip.is_link_local:  # a PC dials one only with a zone of its own interface (fe80::1%eth0)
            raise ValueError(f"--address {text}: {host} is a link-local address, which other PCs can dial only "
                             "through an interface of their own that they would have to name: give this PC's "
                             "global or unique-local address, its IPv4 address or its host name")
    return tuple(with_default_port(text, DEFAULT_PORT) for text in given)


def _init(args: argparse.Namespace) -> int:
    from deskfleet.agent.link import utc_now
    from deskfleet.common import pki
    from deskfleet.controller.fleet_ca import default_address, init_fleet

    store = _store(args)
    addresses = _addresses(args.address or [default_address()])
    ca = init_fleet(store, args.name, addresses, utc_now(), force=args.force)
    print(f"fleet {pki.fleet_id(ca.certificate)} created in {store.data_dir}")
    print(f"agents will reach the controller at {', '.join(addresses)}; run `deskfleet fleet "
          f"serve{store.data_dir_option}` there")
    return 0


def _token(args: argparse.Namespace) -> int:
    from deskfleet.agent.link import utc_now
    from deskfleet.common.join_tokens import encode_join_token
    from deskfleet.controller.fleet_ca import MAX_TOKEN_USES, addresses_elsewhere, issue_token, parse_duration

    if not 1 <= args.uses <= MAX_TOKEN_USES:
        raise ValueError(f"--uses must be from 1 to {MAX_TOKEN_USES:,} PCs, got {args.uses}")
    store = _store(args)
    lifetime = parse_duration(args.ttl)
    token = issue_token(store, utc_now(), lifetime, args.uses, _addresses(args.address or ()))
    print(encode_join_token(token))
    if lifetime > LONG_TOKEN_TTL:  # a bearer credential: whoever holds it joins a PC, for as long as it lasts
        print(f"warning: this token lets whoever holds it join {args.uses} PC(s) for {lifetime.days} days: keep it as "
              "a password (the default is 24h)", file=sys.stderr)
    elif args.uses > MANY_TOKEN_USES:
        print(f"warning: this token lets whoever holds it join {args.uses} PCs: keep it as a password, and give a "
              "roll-out's tokens the --ttl it needs", file=sys.stderr)
    if addresses_elsewhere(token.controller_addresses):
        print(f"warning: the token's controller address(es) ({', '.join(token.controller_addresses)}) are not this "
              "PC's: a PC joins only if one reaches this controller; moved, give --address HOST:PORT (or edit "
              f"`addresses` in {store.data_dir / 'fleet.json'})", file=sys.stderr)
    if store.served() is False:  # the join would fail with "cannot reach the controller" and no word of why
        print(f"warning: no `deskfleet fleet serve` runs on {store.data_dir}: a PC can join only while it runs; "
              "start it", file=sys.stderr)
    # `join -` first: a token on the command line shows in the PC's process list and shell history
    print(f"valid until {token.expires_at.isoformat()} for {args.uses} join(s); on the PC run: "
          "deskfleet-agent join - (then paste the token), or deskfleet-agent join - < token.txt", file=sys.stderr)
    return 0


def _remove(args: argparse.Namespace) -> int:
    from deskfleet.common.pki import PkiError
    from deskfleet.controller.fleet_ca import Revocations, remove_agent

    store = _store(args)
    store.require_initialised()
    try:
        removed_before = Revocations(store)().agent_ids
    except PkiError:  # the list is lost or damaged: remove_agent names the file and how to restore it
        removed_before = frozenset()
    agent_id = remove_agent(store, args.agent)
    if agent_id in removed_before:
        print(f"agent {agent_id} was already removed: it stays refused")
    else:
        print(f"removed agent {agent_id}: it is refused from now on")
    return 0


def _default_listen(addresses: tuple[str, ...], port: int) -> str:
    """Where `fleet serve` listens without --listen: every interface at the agents' port, or, where agents are told
    to reach it at loopback addresses alone (`fleet init --address 127.0.0.1:PORT`: every agent on this PC), the
    first of those, so that a fleet kept on one PC opens no port to the LAN."""
    if addresses and all(is_loopback_address(address) for address in addresses):
        return addresses[0]
    return f"0.0.0.0:{port}"


def _serve(args: argparse.Namespace) -> int:
    import logging

    from deskfleet.common.wire import ProtocolError, parse_address
    from deskfleet.controller.fleet_ca import addresses_elsewhere, fleet_addresses
    from deskfleet.controller.fleet_server import FleetServer

    if not args.verbose:  # -v's DEBUG stands: setting INFO here hid deskfleet's own debug lines under -v
        logging.getLogger("deskfleet").setLevel(logging.INFO)
    store = _store(args)
    addresses = fleet_addresses(store)
    if addresses and addresses_elsewhere(addresses):  # a controller moved: agents find it over mDNS, new PCs cannot
        logging.getLogger(__name__).warning(
            "none of the addresses agents are told to reach this controller at (%s, in %s) is this PC's: a PC "
            "joining with a new token dials them; `deskfleet fleet token --address HOST:PORT` gives the new one",
            ", ".join(addresses), store.data_dir / "fleet.json")
    port = parse_address(addresses[0])[1] if addresses else DEFAULT_PORT  # where the agents are told to come
    if args.listen is not None:
        try:  # named as given, not with the port added (FleetServer's own check would)
            parse_address(args.listen, default_port=port)  # port 0: no agent could be told where it is
        except ProtocolError as error:
            raise ValueError(f"--listen: {error}") from None
    listen = _default_listen(addresses, port) if args.listen is None else with_default_port(args.listen, port)
    server = FleetServer(store, listen)

    async def run() -> None:
        import signal

        loop = asyncio.get_running_loop()
        handled = []
        stopped_by: list[int] = []

        def stop(signum: int) -> None:
            stopped_by.append(signum)
            server.stop()

        for signum in stopping_signals():  # SIGHUP: the terminal or SSH session it was started from closed
            try:
                loop.add_signal_handler(signum, stop, signum)
                handled.append(signum)
            except (NotImplementedError, RuntimeError):
                pass
        try:
            await server.run()
        finally:  # uvloop leaves its handlers installed after it closes: later signals would be swallowed
            for signum in handled:
                loop.remove_signal_handler(signum)
        if stopped_by:
            logging.getLogger(__name__).info("fleet serve stopped by %s", signal.Signals(stopped_by[0]).name)

    event_loop.run(run())
    return 0


# Private methods: agents

def _survey_options(args: argparse.Namespace) -> Any:
    from deskfleet.controller.fleet_survey import SurveyOptions

    return SurveyOptions(peers=tuple(args.peer), discover_seconds=args.discover_seconds)


def _ls(args: argparse.Namespace) -> int:
    from deskfleet.controller.fleet_listing import agent_json, list_fleet

    listing = event_loop.run(list_fleet(_store(args), _survey_options(args)))
    if args.json:  # the list stays a list of agents: the controller's and the CA's dates go to stderr
        print_whole(json.dumps([agent_json(agent, listing.undeployed) for agent in listing.agents], indent=2))
        for line in listing.advice + listing.notes + listing.warnings:
            print(line, file=sys.stderr)
        return 0
    if not listing.agents:
        print("no agents found (is `deskfleet fleet serve` running, and have agents joined?)")
    else:
        _print_agents(listing.agents, listing.undeployed)
    for line in listing.notes + listing.warnings:
        print(line)
    return 0



def _window(args: argparse.Namespace) -> int:
    from deskfleet.controller.fleet_window import FleetWindowOptions, run_fleet_window

    store = _store(args)
    store.require_initialised()  # said at once (exit 2), not in a window that stays empty
    return run_fleet_window(store, FleetWindowOptions(_survey_options(args), args.every))


def _print_agents(agents: list[Any], undeployed: dict[str, list[Any]] | None = None) -> None:
    """The table (in listing order: a test gives them in any), then a line that counts each state, then the PCs to
    upgrade. Each column is as wide as its longest
    cell: fixed widths let an IPv6 address or a long hostname push the rest of its row out of line."""
    from deskfleet.controller.fleet_listing import (
        CELL_HEADINGS,
        agent_cells,
        listing_order,
        state_counts,
        upgrade_advice,
    )

    ordered = sorted(agents, key=listing_order)
    rows = [tuple(CELL_HEADINGS), *(tuple(agent_cells(agent, undeployed)) for agent in ordered)]
    right = {CELL_HEADINGS.index(name) for name in ("free", "disk", "cpu", "igpu", "temp")}
    for line in format_table(rows, right_aligned=right):
        print(line)
    print(state_counts(ordered, undeployed))
    for line in upgrade_advice(agents):
        print(line)



def _add_paper_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=path_argument, default=None, help="export folder (or describe one on paper)")
    # The on-paper options default to None so that one given beside --model is refused, not ignored.
    parser.add_argument("--layers", type=_paper_layers, default=None,
                        help=f"on paper: decoder layers (at most {MAX_PAPER_LAYERS})")
    parser.add_argument("--layer-bytes", type=byte_count, default=None, help="on paper: weight bytes per layer")
    parser.add_argument("--embed-bytes", type=byte_count, default=None, help="on paper: embedding bytes (default 0)")
    parser.add_argument("--head-bytes", type=byte_count, default=None,
                        help="on paper: final norm + lm_head bytes (default 0)")
    parser.add_argument("--kv-bytes-per-token", type=byte_count, default=None,
                        help="on paper: KV bytes per token per layer (default 0)")
    parser.add_argument("--context", type=positive_int, default=None,
                        help=f"on paper: context to reserve KV for (default {PAPER_CONTEXT})")
    parser.add_argument("--width", type=positive_int, default=None, metavar="HIDDEN+INTERMEDIATE",
                        help="on paper: hidden_size + intermediate_size of a layer, to reserve the prefill scratch "
                             "a deploy reserves (without it none is counted)")
    parser.add_argument("--assume-agent", action="append", type=byte_count, default=[], metavar="FREE_BYTES",
                        help="plan for a hypothetical agent with this much free memory (repeatable); alone, the plan "
                             "is over these only; with --peer, over them and the fleet a survey finds")


def _paper_layers(text: str) -> int:
    """argparse type: decoder layers of a model on paper, 1 to MAX_PAPER_LAYERS."""
    layers = positive_int(text)
    if layers > MAX_PAPER_LAYERS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_PAPER_LAYERS}, got {layers} (--layer-bytes takes "
                                         "the bytes)")
    return layers


def _plan(args: argparse.Namespace) -> int:
    from deskfleet.common.agent_state import AgentState
    from deskfleet.common.model_spec import MANIFEST_NAME, load_manifest
    from deskfleet.common.planner import AgentCandidate, plan
    from deskfleet.common.wire import Precision
    from deskfleet.controller.fleet_deploy import (
        check_deploy_settings,
        footprint_of,
        model_id_of,
        paper_footprint,
        plan_survey,
        policy_options,
    )
    from deskfleet.controller.fleet_survey import survey
    from deskfleet.controller.plan_text import render_plan

    check_deploy_settings(Precision(args.precision), args.kv_cache)  # what deploy would refuse
    on_paper = [f"--{name.replace('_', '-')}" for name in PAPER_OPTIONS if getattr(args, name) is not None]
    if args.model is not None:
        if on_paper:
            raise ValueError(f"{', '.join(on_paper)} describe a model on paper: leave them out with --model (its "
                             "export says what they would)")
        footprint = footprint_of(load_manifest(args.model), args.device, Precision(args.precision), args.kv_cache,
                                 (args.model / MANIFEST_NAME).stat().st_size)
    elif args.layers is not None and args.layer_bytes is not None:
        footprint = paper_footprint(args.layers, args.layer_bytes, args.embed_bytes or 0, args.head_bytes or 0,
                                    args.kv_bytes_per_token or 0, args.context or PAPER_CONTEXT, args.device,
                                    Precision(args.precision), args.kv_cache, args.width)
    else:
        raise ValueError("give --model OUT_DIR, or --layers N and --layer-bytes B to plan on paper")
    assumed = [AgentCandidate(f"assumed-{index}", AgentState.AVAILABLE, size, 1.0)
               for index, size in enumerate(args.assume_agent)]
    options = policy_options(args.policy, args.streams, args.hop_ms, args.device)
    if assumed and not args.peer:
        result = plan(footprint, assumed, options)
    else:
        async def run() -> Any:
            found = await survey(_store(args), _survey_options(args))
            try:
                model_id = model_id_of(args.model) if args.model is not None else None
                # before close(): it needs the links
                return plan_survey(footprint, found, options, assumed=assumed, model_id=model_id)
            finally:
                await found.close()

        result = event_loop.run(run())
    if args.json:
        print_whole(json.dumps({"feasible": result.feasible, "problems": list(result.problems),
                                "stages": [[s.agent_id, s.first_layer, s.stop_layer] for s in result.stages],
                                "left_out": [[e.agent_id, e.reason.value, e.message] for e in result.exclusions]}))
    else:
        print(render_plan(result))
    return 0 if result.feasible else 1


def _deploy(args: argparse.Namespace) -> int:
    from deskfleet.common.wire import Precision
    from deskfleet.controller.fleet_deploy import (
        VERIFY_NOTE_BYTES,
        DeployError,
        deploy,
        load_deploy_settings,
        policy_options,
        verify_export,
    )
    from deskfleet.controller.fleet_survey import survey
    from deskfleet.controller.plan_text import render_plan

    store = _store(args)
    before = _deployed_settings(store, args.model)
    last_percent: dict[tuple[str, str], int] = {}

    def progress(agent_id: str, file_name: str, sent: int, total: int) -> None:
        percent = 100 * sent // max(total, 1)
        if last_percent.get((agent_id, file_name), -1) // 25 != percent // 25 or sent == total:
            last_percent[(agent_id, file_name)] = percent
            print(f"  {agent_id[:12]} {file_name}: {sent}/{total} bytes ({percent}%)", file=sys.stderr, flush=True)

    async def run() -> Any:
        found = await survey(store, _survey_options(args))
        try:
            return await deploy(store, args.model, found, policy_options(args.policy, args.streams, args.hop_ms),
                                Precision(args.precision), args.device, progress, kv_cache=args.kv_cache)
        finally:
            await found.close()

    # every file of the export hashed, before the survey and the deploy lock (a run's failover waits on the lock):
    # a file damaged there that every PC already held deployed fine, and failed the first re-plan that sent it
    verify_export(args.model, lambda files, size: print(
        f"checking the export: {files} file(s), {size / 1e9:.1f} GB ...", file=sys.stderr, flush=True)
        if size >= VERIFY_NOTE_BYTES else None)

    try:
        # SIGTERM and SIGHUP unwind it as Ctrl-C does (exit 143 / 129), releasing the stages it gave: their default
        # ended the process on the spot, and a PC kept a stage no deployment records (the fleet window's Stop, a
        # service manager's stop, a closed terminal)
        with signals_unwind(ctrl_c=False):
            result, report = event_loop.run(run())
    except DeployError as error:
        if not error.failed_run or args.verbose:  # what the user gave: a usage error's exit status 2
            raise
        print(f"deskfleet: error: {error}", file=sys.stderr)  # a PC failed it, or the PCs cannot hold the plan
        return 1
    except KeyboardInterrupt as stopped:  # it ended with exit 130 and not a word: was anything lost, or half deployed?
        by = "Ctrl-C" if stopping_signal(stopped) == signal.SIGINT else signal_name(stopped)
        say_stopped(f"deskfleet: deploy stopped by {by}: the files the PCs received stay in their caches, and the "
                    "next `deskfleet fleet deploy` sends only the rest; the model's deployment on record is the one "
                    "before (it is written once every stage is ready), and the PCs were asked to release the stages "
                    "this deploy gave them")
        raise
    if args.json:
        print_whole(json.dumps({"model_id": report.model_id, "bytes_sent": report.bytes_sent,
                                "files_sent": report.files_sent,
                                "stages": [[s.agent_id, s.address, s.layer_start, s.layer_end]
                                           for s in report.stages]}))
    else:
        print(render_plan(result))
        total = sum(report.bytes_sent.values())
        print(f"deployed {report.model_id}: {len(report.stages)} stage(s) ready, {total} bytes in "
              f"{sum(report.files_sent.values())} file(s) sent")
    if before is not None and (changes := load_deploy_settings(store, args.model).changes_from(before)):
        # a deploy run again with fewer options re-planned with the defaults (precision f32 became device_default)
        # and said nothing: "running it again sends nothing" read as "nothing changes"
        print(f"note: deployed with other settings than the deployment before it: {', '.join(changes)} (a deploy "
              "takes no option from the one before: give them again to keep them)", file=sys.stderr)
    return 0


def _deployed_settings(store: FleetStore, model: Path) -> DeploySettings | None:
    """The settings of the model's deployment on record, or None when there is none (or it, or
    the export, cannot be read: the deploy names that)."""
    from deskfleet.common.model_spec import ManifestError
    from deskfleet.controller.fleet_deploy import DeployError, load_deploy_settings, load_deployment

    try:
        load_deployment(store, model)
        return load_deploy_settings(store, model)
    except (DeployError, OSError, ManifestError):
        return None


def _generate(args: argparse.Namespace) -> int:
    from deskfleet.controller.chat import generate_on_fleet
    from deskfleet.controller.fleet_failover import FailoverError
    from deskfleet.controller.run import GenerateOptions, GenerationInterrupted, GenerationStopped

    options = GenerateOptions(model=args.model, prompt_ids=[parse_token_ids(args.prompt_ids)],
                              max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)
    try:
        with signals_unwind(ctrl_c=False):  # SIGTERM and SIGHUP stop it as Ctrl-C does (exit 143 / 129)
            # --peer and --discover-seconds: what a re-plan dials and browses when a PC drops out (they were ignored)
            report = generate_on_fleet(options, args.data_dir, discover_seconds=args.discover_seconds,
                                       peers=tuple(args.peer))
    except GenerationInterrupted as interrupted:  # Ctrl-C: the tokens made so far are printed, then exit 130
        print_whole(_generated(interrupted.report, args.json))
        if interrupted.signum != signal.SIGINT:  # a Ctrl-C shows where it was typed; a SIGTERM from elsewhere does not
            say_stopped(f"deskfleet: stopped by {signal_name(interrupted)}")
        raise
    except GenerationStopped as stopped:  # a failed run (exit 1), as `generate --fleet`'s: what it made is kept
        print_whole(_generated(stopped.report, args.json))
        print(f"deskfleet: error: {stopped}", file=sys.stderr)
        return 1
    except FailoverError as error:  # the chain could not be opened nor re-planned: nothing was made
        print(f"deskfleet: error: {error}", file=sys.stderr)
        return 1
    print_whole(_generated(report, args.json))
    return 0


def _generated(report: dict[str, Any], as_json: bool) -> str:
    """`fleet generate`'s output of a run's report: the token ids, space-separated, or under --json an object of
    them with the re-plans and failovers a PC that dropped out caused, and why the run stopped early (Ctrl-C,
    or a chain past mending) where it did. A stopped run printed nothing: its tokens were lost."""
    tokens = report["tokens"]
    assert isinstance(tokens, list)
    if not as_json:
        return " ".join(map(str, tokens))
    return json.dumps({"tokens": tokens, **{key: report[key] for key in ("replans", "rejoined", "failovers", "stopped")
                                            if key in report}})
