"""What the programs say when started wrong, before they reach any shard:
one line, naming the flag and what to give instead."""

import subprocess

import pytest

from shards import CLI_BINARY, SHARD_BINARY


def run(*args):
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("command, flag", [
    (["fetch", "--layer", "0", "--out", "x.safetensors"], "--timeout-ms"),
    (["export", "--out", "x.safetensors"], "--timeout-ms"),
    (["manifest"], "--connect-timeout-ms"),
])
def test_a_zero_timeout_is_refused_naming_the_flag(command, flag):
    # Port 1 on loopback: nothing listens, and nothing is dialled anyway.
    code, output = run(CLI_BINARY, *command, "--shards", "127.0.0.1:1", flag, "0")
    assert code == 2, output
    assert f"{flag} is 0, which no call can meet: give at least 1" in output, output
    assert "Deadline" not in output


def test_a_missing_config_file_says_why(tmp_path):
    code, output = run(SHARD_BINARY, "--config", str(tmp_path / "missing.json"))
    assert code == 2, output
    assert f"cannot read config file {tmp_path / 'missing.json'}: No such file or directory" \
        in output, output
