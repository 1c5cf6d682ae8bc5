"""`recap serve --replicas`: without the option nothing of Ray is imported, and without Ray the
option is a one-line input error (no Ray needed here)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from recap import cli
from recap.errors import InputError


def test_the_single_server_never_imports_ray():
    code = ("import sys, recap.cli, recap.serve, recap.serve.app, recap.serve.engine, recap.serve.router, "
            "recap.serve.shared; assert 'ray' not in sys.modules, 'ray was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_replicas_without_ray_is_an_input_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "recap.serve.scale", None)  # as if Ray were not installed
    args = argparse.Namespace(replicas=2, ray_address=None, replica_cpus=None)
    with pytest.raises(InputError, match=r"recap-decoding\[ray\]"):
        cli._scaled_engine(args)


def test_serve_takes_the_scaling_options():
    parser = cli._Parser(prog="recap")
    commands = parser.add_subparsers(dest="command")
    cli._add_serve(commands)
    args = parser.parse_args(["serve", "--model", "tiny-llama", "--replicas", "3", "--ray-address", "auto",
                              "--replica-cpus", "2"])
    assert (args.replicas, args.ray_address, args.replica_cpus) == (3, "auto", 2.0)
    assert parser.parse_args(["serve", "--model", "tiny-llama"]).replicas is None
