"""The command line: options generated from the dataclasses parse both ways, every command has help."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.cli import build_parser
from radixserve.config import ServerArgs
from radixserve.router.config import RouterArgs


def test_a_switch_that_defaults_on_can_be_turned_off() -> None:
    p = build_parser()
    assert ServerArgs.from_cli_args(p.parse_args(["serve"])).idle_self_check is True
    assert ServerArgs.from_cli_args(p.parse_args(["serve", "--no-idle-self-check"])).idle_self_check is False
    assert ServerArgs.from_cli_args(p.parse_args(["serve", "--enable-metrics"])).enable_metrics is True


def test_router_options_parse_with_sgl_router_defaults() -> None:
    ns = build_parser().parse_args(["router", "--worker-urls", "http://a:1", "http://b:2", "--policy", "round_robin",
                                    "--dp-aware", "--balance-abs-threshold", "32"])
    args = RouterArgs.from_cli_args(ns)
    assert args.worker_urls == ("http://a:1", "http://b:2") and args.policy == "round_robin" and args.dp_aware
    assert (args.balance_abs_threshold, args.balance_rel_threshold, args.cache_threshold) == (32, 1.5, 0.3)
    with pytest.raises(ValueError, match="must start with http"):
        RouterArgs(worker_urls=("a:1",))


def test_launch_passes_engine_options_to_workers_and_router_options_to_the_router() -> None:
    from radixserve.router.launch import worker_command

    ns = build_parser().parse_args(["launch", "--num-workers", "3", "--port", "31000", "--max-total-tokens", "4096",
                                    "--schedule-policy", "lpm", "--policy", "power_of_two", "--no-idle-self-check",
                                    "--enable-metrics"])
    assert ns.num_workers == 3 and ns.policy == "power_of_two"
    cmd = worker_command(ServerArgs.from_cli_args(ns), 31001, threads=1)
    assert cmd[cmd.index("--port") + 1] == "31001"
    assert cmd[cmd.index("--max-total-tokens") + 1] == "4096" and cmd[cmd.index("--schedule-policy") + 1] == "lpm"
    assert cmd[cmd.index("--num-threads") + 1] == "1" and "--policy" not in cmd
    assert "--no-idle-self-check" in cmd and "--enable-metrics" in cmd


def test_launch_gives_the_keys_to_the_workers_and_the_router_and_logs_neither() -> None:
    from radixserve.router.launch import fleet_args, masked, worker_command

    ns = build_parser().parse_args(["launch", "--num-workers", "2", "--port", "31000", "--api-key", "sk-user-7c1",
                                    "--admin-api-key", "sk-root-9d2"])
    sargs, rargs = fleet_args(ns)
    assert rargs.worker_urls == ("http://127.0.0.1:31001", "http://127.0.0.1:31002")
    assert (rargs.api_key, rargs.admin_api_key) == ("sk-user-7c1", "sk-root-9d2")
    cmd = worker_command(sargs, 31001, threads=1)
    assert cmd[cmd.index("--api-key") + 1] == "sk-user-7c1" and cmd[cmd.index("--admin-api-key") + 1] == "sk-root-9d2"
    logged = " ".join(masked(cmd))
    assert "sk-user" not in logged and "sk-root" not in logged and "--admin-api-key ***" in logged


@pytest.mark.parametrize("command", ["generate", "serve", "router", "launch", "simulate"])
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, "--help"])
    assert e.value.code == 0 and "--" in capsys.readouterr().out


def test_radixserve_engine_from_the_package_root() -> None:
    import radixserve
    from radixserve.engine import Engine

    assert radixserve.Engine is Engine


@pytest.mark.parametrize("command", ["fuzz", "soak"])
def test_reliability_benches_explain_every_option(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    bench = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    assert sub.description and len(sub.description) > 200
    for action in sub._actions:
        assert action.help, action.option_strings
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", command, "--help"])
    assert e.value.code == 0 and "--base-url" in capsys.readouterr().out


@pytest.mark.slow  # two CLI processes
def test_an_unreadable_model_file_is_one_line_and_exit_1(tmp_path: Any) -> None:
    """A truncated GGUF (serve) and a file that is not one (generate): the reason on one line, no
    traceback, exit code 1, before any model process reads it."""
    import subprocess
    import sys

    from radixserve.bench.subprocs import free_ports
    from radixserve.model.loader import default_model_path

    truncated = tmp_path / "truncated.gguf"
    with open(default_model_path(), "rb") as f:
        truncated.write_bytes(f.read(20_000_000))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"\x00" * 100)
    for command, path, why in (("serve", truncated, "past the end of the file"),
                               ("generate", garbage, "no GGUF magic")):
        args = ["--port", str(free_ports(1)[0])] if command == "serve" else ["hello"]
        r = subprocess.run([sys.executable, "-m", "radixserve.cli", command, "--model-path", str(path), *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1, r.stderr
        assert why in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_parser_and_the_servers_children_list_import_no_torch() -> None:
    """``radixserve serve``'s own process parses the command line and starts the children: neither
    may import torch (the scheduler's, ~200 MB and a second of start-up)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from radixserve.cli import build_parser\n"
            "from radixserve.config import ServerArgs\n"
            "from radixserve.server.launch import _children\n"
            "from radixserve.server.procs import IpcNames\n"
            "build_parser()\n"
            "kids = _children(ServerArgs(), IpcNames('/nonexistent'), 0)\n"
            "assert [k[0] for k in kids] == ['scheduler', 'detokenizer'], kids\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
