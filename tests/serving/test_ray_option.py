"""``serve --ray`` / ``--replicas``: refused with one line before any model is loaded (this version does not
serve as a Ray Serve deployment)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from h2o_compress.serving import check_ray, serve
from h2o_compress.utils.errors import ConfigError

pytest.importorskip("fastapi")


def test_replicas_need_ray_and_a_positive_count():
    check_ray(None, 1)
    with pytest.raises(ConfigError, match="--replicas 2 needs --ray"):
        check_ray(None, 2)
    with pytest.raises(ConfigError, match="replicas=0 is invalid"):
        check_ray("local", 0)
    with pytest.raises(ConfigError, match="is empty"):
        check_ray(" ", 1)


def test_ray_is_refused_before_the_model_loads():
    with pytest.raises(ConfigError, match="--ray .* is not supported") as caught:
        serve("no-such-model-dir", ray="local", replicas=2)  # a model load would fail with ModelLoadError
    assert "allowed:" in str(caught.value) and "\n" not in str(caught.value)


def test_cli_ray_alone_is_one_line_exit_2():
    done = subprocess.run([sys.executable, "-m", "h2o_compress", "serve", "--model", "no-such-model-dir", "--ray"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("error: --ray (a Ray Serve deployment) is not supported") and done.stderr.count("\n") == 1, done.stderr
