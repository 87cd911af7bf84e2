"""``serve --ray`` / ``--replicas`` / ``--grace-period``: bad values are refused with one line before anything
loads (no model, no Ray started)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from h2o_compress.serving import ServeRequest, request, serve
from h2o_compress.utils.errors import ConfigError

pytest.importorskip("fastapi")


def test_replicas_need_ray_and_a_positive_count():
    assert ServeRequest("m").ray is None and ServeRequest("m").replicas == 1
    with pytest.raises(ConfigError, match="--replicas 2 needs --ray"):
        ServeRequest("m", replicas=2)
    with pytest.raises(ConfigError, match="replicas=0 is invalid"):
        ServeRequest("m", ray="local", replicas=0)
    with pytest.raises(ConfigError, match="is empty"):
        ServeRequest("m", ray=" ")
    with pytest.raises(ConfigError, match="'nonsense' is not HOST:PORT"):
        ServeRequest("m", ray="nonsense", replicas=2)


def test_ray_needs_a_fixed_port_and_ray_serve(monkeypatch):
    monkeypatch.setattr(request, "RAY_SERVE_NEEDS", ("json",))  # installed or not here (CI has no Ray Serve)
    with pytest.raises(ConfigError, match="--port 0 with --ray is invalid"):
        ServeRequest("m", ray="local", replicas=2, port=0)
    assert ServeRequest("m", ray=" local ", replicas=2).ray == "local"  # the address as checked
    monkeypatch.setattr(request, "RAY_SERVE_NEEDS", ("no_such_module_h2o",))
    with pytest.raises(ConfigError, match=r"needs Ray Serve.*pip install 'h2o-compress\[serve-ray\]'"):
        ServeRequest("m", ray="local", replicas=2)


def test_grace_period_is_a_number_of_seconds():
    assert ServeRequest("m", grace_period=0).grace_period == 0.0
    assert isinstance(ServeRequest("m", grace_period=2).grace_period, float)
    for bad in (-1, float("nan"), float("inf"), "30", True):
        with pytest.raises(ConfigError, match="grace_period=.* is invalid"):
            ServeRequest("m", grace_period=bad)


def test_bad_ray_settings_are_refused_before_the_model_loads():
    with pytest.raises(ConfigError, match="replicas=0 is invalid") as caught:
        serve("no-such-model-dir", ray="local", replicas=0)  # a model load would fail with ModelLoadError
    assert "allowed:" in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("args, message", [
    (["--ray", "--replicas", "0"], "error: replicas=0 is invalid"),
    (["--grace-period", "-1"], "error: grace_period=-1.0 is invalid"),
])
def test_cli_refuses_in_one_line_exit_2(args, message):
    done = subprocess.run([sys.executable, "-m", "h2o_compress", "serve", "--model", "no-such-model-dir", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr
