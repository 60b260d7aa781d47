"""Any string in any FT_* variable is either a usable configuration or exit 2 naming the variable: never another
exception, never a hang, never a write to the volume.

Values are drawn by hypothesis (arbitrary unicode, whitespace, huge and special numbers) and, for the
strings a user is most likely to mistype, from a fixed list.  The examples are derandomized so that CI
sees the same ones every run; raise `max_examples` locally to explore further.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, assume, example, given
from hypothesis import settings as explore
from hypothesis import strategies as st

from conftest import ROOT
from trainer.core import config as job_config
from trainer.core import settings as settings_table
from trainer.core.errors import ConfigError
from trainer.model import memory, recipe

NAMES = sorted(settings_table.BY_ENV_NAME)
TRICKY = [
    "", " ", "\t\n", "nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e309", "-1e309", "1e-400", "-0", "-0.0", "+1", "08", "0x10", "1_000",
    " 5 ", "٣", "𝟙", "½", "9" * 400, "1" * 5000, str(2**31), str(2**32), str(2**64), "1e18", "true", "True", "yes", "None", "null", "ａｕｔｏ",
    "AUTO", "demo ", "bf16", "Qwen/Qwen3-4B\n", "../../etc", "a.b.c.d", "ü" * 300,
]
TEXT = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")  # what an environment can hold: no NUL, no lone surrogate
VALUES = st.one_of(st.sampled_from(TRICKY), st.text(TEXT, max_size=30), st.integers().map(str), st.floats().map(repr), st.decimals(allow_nan=True).map(str))
FUZZ = explore(max_examples=400, deadline=2000, derandomize=True, database=None)


def _demo_shape():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


DEMO_SHAPE = _demo_shape()


@contextlib.contextmanager
def within(seconds: int):
    """A hang fails the example instead of stalling the suite (hypothesis checks its deadline only once a call returns)."""

    def hung(*_):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def parse(env: dict[str, str]):
    """What entrypoint.py does before it starts the training process: parse, then derive the configuration (CPU here)."""
    return job_config.build(settings_table.load(env), cuda=False, bf16_supported=False)


def assert_usable(config: job_config.Config) -> None:
    """Every value within what its setting documents, and what the training process builds from it builds."""
    values = config.settings
    for s in settings_table.TABLE:
        value = getattr(values, s.name)
        if isinstance(s.kind, tuple) or value in s.words:
            assert value in (s.kind if isinstance(s.kind, tuple) else s.words), (s.env_name, value)
            continue
        assert type(value) is s.kind, (s.env_name, value)
        if s.kind in (int, float):
            assert math.isfinite(value) and not (s.kind is float and math.copysign(1, value) < 0 and value == 0), (s.env_name, value)
            assert s.minimum is None or value >= s.minimum, (s.env_name, value)
            assert s.maximum is None or value <= s.maximum, (s.env_name, value)
    assert job_config.Config.from_json(config.to_json()) == config  # handed to the training process unchanged
    plan = memory.plan(DEMO_SHAPE, 500_000, values, config.precision, 80e9, values.activation_checkpointing)
    recipe.sft_config(values, config.precision, plan, cuda=False)


@pytest.fixture(scope="module", autouse=True)
def imported_once():
    """The first parse imports trl and the recipe (seconds on a busy machine): done here, so the deadline times each
    example's own work."""
    assert_usable(parse({"FT_PLATFORM": "none", "FT_OUTPUT_DIR": "/nonexistent/volume"}))


@pytest.mark.faults("arbitrary strings in one FT_* variable")
@FUZZ
@given(name=st.sampled_from(NAMES), value=VALUES)
@example(name="FT_LEARNING_RATE", value="nan").via("a float that is not a number")
@example(name="FT_SEED", value=str(2**32)).via("beyond numpy's seed range")
@example(name="FT_BATCH_SIZE", value=str(2**31 - 1)).via("the memory plan would try every split of the step")
@example(name="FT_EVAL_FRACTION", value="-0").via("negative zero")
def test_any_value_of_one_variable_is_usable_or_an_error_naming_it(name, value):
    env = {"FT_PLATFORM": "none", "FT_OUTPUT_DIR": "/nonexistent/volume"} | {name: value}
    with within(5):
        try:
            config = parse(env)
        except ConfigError as error:
            assert name in str(error), str(error)
            return
        assert_usable(config)


@pytest.mark.faults("arbitrary strings in several FT_* variables")
@FUZZ
@given(env=st.dictionaries(st.sampled_from(NAMES), VALUES, min_size=2, max_size=6))
def test_any_values_of_several_variables_are_usable_or_an_error_naming_one_of_them(env):
    env = {"FT_PLATFORM": "none", "FT_OUTPUT_DIR": "/nonexistent/volume"} | env
    with within(5):
        try:
            config = parse(env)
        except ConfigError as error:
            assert any(name in str(error) for name in env), str(error)
            return
        assert_usable(config)


FIXED = ("FT_OUTPUT_DIR", "FT_TERMINATION_MESSAGE_PATH")  # where the test looks for writes


@pytest.mark.faults("invalid values through entrypoint.py")
@explore(max_examples=6, deadline=None, derandomize=True, database=None,
         suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(env=st.dictionaries(st.sampled_from([n for n in NAMES if n not in FIXED]), VALUES, min_size=1, max_size=4))
def test_invalid_values_through_entrypoint_exit_2_without_a_traceback_or_a_write(env, tmp_path_factory):
    base = {"FT_PLATFORM": "none", "FT_OUTPUT_DIR": "/nonexistent/volume"}
    try:
        parse(base | env)
    except ConfigError:
        pass
    else:
        assume(False)  # a valid configuration would start training
    folder = tmp_path_factory.mktemp("fuzz")
    process_env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_", "MLFLOW_", "FULLTUNE_", "FAULT_"))}
    process_env |= {"HF_HUB_OFFLINE": "1", "FT_OUTPUT_DIR": str(folder / "volume"), "FT_TERMINATION_MESSAGE_PATH": str(folder / "termination-log")} | env
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(ROOT / "entrypoint.py")], env=process_env, cwd=folder, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < 30
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and any(name in result.stderr for name in env), result.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["termination-log"], "nothing but the termination message is written"
