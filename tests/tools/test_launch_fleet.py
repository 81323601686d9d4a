"""tools/launch_fleet.py: ports it cannot use (and flags it cannot parse) end the launch with one message before any
process starts (a server left on a worker's port would answer /health in its place)."""

import socket

import pytest

from tools import launch_fleet


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--base-port", "{busy-1}"], "of worker 1 (--base-port + 1) on 127.0.0.1: Address already in use"),
        (["--base-port", "{free}", "--router-port", "{busy}"], "of the router (--router-port) on 127.0.0.1"),
        (["--base-port", "30000", "--router-port", "29999"], "port 30000 is both worker 0 (--base-port + 0)'s and"),
        (["--base-port", "65535"], "port 65536 of worker 1 (--base-port + 1) is not in [1, 65535]"),
        (["--host", "no.such.host.invalid"], "--host no.such.host.invalid: not an address of this machine"),
        (
            ["--base-port", "{free}", "--router-port", "{free+5}", "--worker-args", "'--tp-size 2"],
            '--worker-args "\'--tp-size 2": No closing quotation',
        ),
        (["--max-lora-rank", "8"], "--max-lora-rank without --enable-lora: pass --enable-lora too"),
        (["--enable-lora", "--max-lora-rank", "8"], "--enable-lora needs --max-lora-rank and --lora-target-modules"),
    ],
)
def test_launch_mistakes_exit_2_before_starting_anything(flags, message, model_dir, busy_port, capsys):
    subs = {"{busy}": busy_port, "{busy-1}": busy_port - 1, "{free}": busy_port + 10, "{free+5}": busy_port + 15}
    argv = ["--model-path", model_dir, "--workers", "2", *(str(subs.get(f, f)) for f in flags)]
    with pytest.raises(SystemExit) as e:
        launch_fleet.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
