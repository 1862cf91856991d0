"""The job-parameter flags are generated from JobParams, and one check (`job_params`) turns params into
JobParams or an InputError for the API, the CLI and the embedded runner."""

from __future__ import annotations

import argparse

import pytest

from jobs.cli.main import build_parser
from jobs.cli.params import HAND_WRITTEN_FLAGS, flag_name, params_from_args
from jobs.cli.summarize import summarize_params
from jobs.domain.errors import InputError
from jobs.domain.schemas import JobParams, job_params

pytestmark = pytest.mark.unit  # the unit lane (scripts/test.sh --unit)

# JobParams fields deliberately without a flag in `freight run` / `freight submit` (none today).
NO_FLAG: dict[str, str] = {}
SUMMARIZE_FLAGS = ("model", "column", "style", "template", "max_tokens", "long_documents", "id_column")


def subcommand(name: str) -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


@pytest.mark.parametrize("command", ["run", "submit"])
def test_every_job_param_has_a_flag(command: str) -> None:
    flags = options(subcommand(command))
    missing = [
        name for name in JobParams.model_fields if name not in NO_FLAG and flag_name(name) not in flags
    ]
    assert not missing, f"JobParams fields without a `freight {command}` flag: {missing}"
    assert set(HAND_WRITTEN_FLAGS) <= set(JobParams.model_fields)
    assert set(NO_FLAG) <= set(JobParams.model_fields)


def test_summarize_flags_are_the_fields_flags() -> None:
    flags = options(subcommand("summarize"))
    assert {flag_name(name) for name in (*SUMMARIZE_FLAGS, "temperature", "seed")} <= flags


def test_flags_convert_to_the_strict_types_and_override_params_json() -> None:
    args = build_parser().parse_args(
        [
            "run", "in.parquet", "-o", "out.parquet",
            "--params", '{"top_k": 2, "max_tokens": 99}',
            "--max-tokens", "8", "--temperature", "0.5", "--top-p", "1", "--seed", "3",
            "--chat", "--no-truncate", "--stop", "a", "--stop", "b", "--metadata", "k=v",
            "--dtype", "float32", "--template", "Say {text}\\n", "--task", "summarize",
        ]
    )  # fmt: skip
    params = params_from_args(args)
    assert params.max_tokens == 8 and type(params.max_tokens) is int
    assert params.temperature == 0.5 and params.top_p == 1.0 and params.seed == 3 and params.top_k == 2
    assert params.chat is True and params.truncate is False and params.stop == ["a", "b"]
    assert params.metadata == {"k": "v"} and params.dtype == "float32" and params.task == "summarize"
    assert params.template == "Say {text}\n"


def test_unset_flags_leave_the_model_defaults() -> None:
    params = params_from_args(build_parser().parse_args(["submit", "in.parquet"]))
    assert params == JobParams()


@pytest.mark.parametrize("argv", [["--quantization", "int4"], ["--max-tokens", "8.5"], ["--chat", "yes"]])
def test_flags_refuse_what_the_field_refuses(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "in.parquet", "-o", "out.parquet", *argv])


def test_out_of_range_flag_is_an_input_error_naming_the_field() -> None:
    args = build_parser().parse_args(["run", "in.parquet", "-o", "out.parquet", "--top-p", "1.5"])
    with pytest.raises(InputError, match="top_p: Input should be less than or equal to 1") as caught:
        params_from_args(args)
    assert caught.value.field == "params"


def test_summarize_params() -> None:
    args = build_parser().parse_args(
        ["summarize", "in.parquet", "-o", "out.parquet", "--template", "S:\\n{text}", "--max-tokens", "5"]
    )
    params = summarize_params(args)
    assert params.task == "summarize" and params.template == "S:\n{text}" and params.max_tokens == 5
    with pytest.raises(InputError, match="max_tokens"):
        summarize_params(build_parser().parse_args(["summarize", "x", "-o", "y", "--max-tokens", "0"]))


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        ({"max_tokens": "8"}, "max_tokens: Input should be a valid integer"),
        ({"max_tokenz": 5}, "max_tokenz: Extra inputs are not permitted"),
        ({"metadata": {"a": 1}}, "metadata.a"),
    ],
)
def test_job_params_names_the_field(payload: dict, fragment: str) -> None:
    with pytest.raises(InputError) as caught:
        job_params(payload)
    assert fragment in caught.value.message and caught.value.field == "params"
    assert caught.value.message.startswith("invalid params: ")
