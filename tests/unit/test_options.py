"""The tuning options are declared once (``pipette.options``): the command line and the API
report the same options with the same defaults, read from their own outputs (the argparse
parsers of ``pipette tune``, ``plan`` and ``submit``; the service's OpenAPI document), and an
option on one side only fails here. A bad value is one line naming the flag or the field.
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from cli import _parser, main
from pipette.errors import SpecError
from pipette.options import OPTIONS, TRIAL_TIMEOUT_S, Scope, defaults, options_for
from pipette.tuner import TuneOptions

#: The flags of each command that are its inputs, not tuning options: a new flag is one or the
#: other, and a new option belongs in pipette.options (then both sides have it).
CLI_INPUTS: dict[str, set[str]] = {
    "tune": {"help", "model", "cluster", "devices", "reprofile", "recipe", "global_batch", "seq_len", "dtype",
             "optimizer", "method", "lora_rank", "lora_alpha", "lora_targets", "recompute", "zero", "schedules",
             "micro_batches", "document_len", "moe_routing", "stack", "data", "checkpoint", "home", "no_memory", "out",
             "json",
             "script_kind", "script_knob", "script_autotp", "script_pipeline", "script_config", "script_unsupported",
             "script_shares_flags", "workdir", "script"},
    "plan": {"help", "model", "cluster", "recipe", "global_batch", "seq_len", "dtype", "optimizer", "method",
             "lora_rank", "lora_alpha", "lora_targets", "recompute", "zero", "schedules", "micro_batches",
             "document_len", "moe_routing", "stack", "out", "no_files", "json", "trace", "explain"},
    "submit": {"help", "file", "set", "name", "watch", "json"},
}
#: The API bodies that carry options, and their fields that are inputs.
API_BODIES: dict[str, tuple[str, set[str]]] = {"tune": ("BudgetIn", set()),
                                               "plan": ("PlanIn", {"model", "training", "cluster", "stack"})}
JSON_TYPES = {int: "integer", float: "number", bool: "boolean"}


@pytest.fixture(autouse=True)
def _sigterm_kept() -> Iterator[None]:
    """``main`` makes SIGTERM raise in this process (as a command does): put pytest's back."""
    kept = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, kept)


def command(name: str, parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    sub = next(a for a in (parser or _parser())._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = sub.choices[name]
    return found


def cli_options(parser: argparse.ArgumentParser, inputs: set[str]) -> dict[str, Any]:
    """Every flag that is not an input, by its destination, with its default."""
    out: dict[str, Any] = {}
    for action in parser._actions:
        if action.dest not in inputs:
            out.setdefault(action.dest, action.default)  # --prune and --no-prune share one
    return out


@pytest.fixture(scope="module")
def openapi(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from service.app import create_app
    from service.settings import Settings

    home = tmp_path_factory.mktemp("home")
    app = create_app(Settings.from_env({"PIPETTE_HOME": str(home), "PIPETTE_SCHEDULER": "0"}))
    document: dict[str, Any] = app.openapi()
    return document


def api_options(openapi: dict[str, Any], body: str, inputs: set[str]) -> dict[str, dict[str, Any]]:
    properties: dict[str, dict[str, Any]] = openapi["components"]["schemas"][body]["properties"]
    return {name: prop for name, prop in properties.items() if name not in inputs}


def api_type(prop: dict[str, Any]) -> str:
    types = [prop.get("type")] + [p.get("type") for p in prop.get("anyOf", ())]
    return next(t for t in types if t not in (None, "null"))


def mismatches(cli: dict[str, Any], api: dict[str, dict[str, Any]], scope: Scope) -> list[str]:
    """What the two sides (and the declaration) disagree on, in words; empty when they agree."""
    declared = {o.name: o for o in options_for(scope)}
    wrong = [f"{name}: on the command line only" for name in cli.keys() - api.keys()]
    wrong += [f"{name}: in the API only" for name in api.keys() - cli.keys()]
    wrong += [f"{name}: not in pipette.options" for name in (cli.keys() | api.keys()) - declared.keys()]
    wrong += [f"{name}: declared, on neither side" for name in declared.keys() - cli.keys() - api.keys()]
    for name in cli.keys() & api.keys() & declared.keys():
        option = declared[name]
        if not cli[name] == api[name].get("default") == option.default:
            wrong.append(f"{name}: defaults {cli[name]!r} (CLI), {api[name].get('default')!r} (API), "
                         f"{option.default!r} (declared)")
        if api_type(api[name]) != JSON_TYPES[option.kind]:
            wrong.append(f"{name}: the API's type is {api_type(api[name])}, declared {option.kind.__name__}")
    return wrong


@pytest.mark.parametrize("scope", ["tune", "plan"])
def test_the_cli_and_the_api_report_the_same_options_and_defaults(openapi: dict[str, Any], scope: Scope) -> None:
    body, inputs = API_BODIES[scope]
    cli = cli_options(command(scope), CLI_INPUTS[scope])
    api = api_options(openapi, body, inputs)
    assert mismatches(cli, api, scope) == []
    assert len(cli) == len(options_for(scope)) > 0


def test_a_job_body_takes_the_budget_schema(openapi: dict[str, Any]) -> None:
    budget = openapi["components"]["schemas"]["JobIn"]["properties"]["budget"]
    assert "BudgetIn" in str(budget)


def test_submit_takes_every_tuning_option_over_the_job_file() -> None:
    submit = cli_options(command("submit"), CLI_INPUTS["submit"])
    assert submit == {o.name: None for o in options_for("tune")}  # None: the job file's, else the default


def test_tune_options_take_their_defaults_from_the_declaration() -> None:
    assert {k: v for k, v in defaults("tune").items() if hasattr(TuneOptions, k)} == \
        {k: getattr(TuneOptions(), k) for k in defaults("tune") if hasattr(TuneOptions, k)}
    assert {f for f in TuneOptions.__dataclass_fields__} <= set(defaults("tune"))


def test_an_option_on_one_side_only_is_caught(openapi: dict[str, Any]) -> None:
    parser = _parser()
    command("tune", parser).add_argument("--warmup", type=int, default=2)
    cli = cli_options(command("tune", parser), CLI_INPUTS["tune"])
    api = api_options(openapi, "BudgetIn", set())
    assert mismatches(cli, api, "tune") == ["warmup: on the command line only", "warmup: not in pipette.options"]
    api["max_trials"] = {**api["max_trials"], "default": 10}  # the drift this replaced: 8 on the CLI, 10 here
    cli.pop("warmup")
    assert mismatches(cli, api, "tune") == ["max_trials: defaults 8 (CLI), 10 (API), 8 (declared)"]
    del api["steps"]
    assert "steps: on the command line only" in mismatches(cli, api, "tune")


def test_every_option_says_its_default_and_fix() -> None:
    for option in OPTIONS:
        assert option.help and option.fix().startswith("give ")
        if option.default is None:
            assert option.unset, option.name
    assert TRIAL_TIMEOUT_S > 0


# ---- bad values: one line naming the flag (exit 1) or the field ----------------------

BAD = [
    ("--max-trials", "0", "is 0"), ("--max-trials", "-3", "is -3"), ("--max-trials", "lots", "not a whole number"),
    ("--max-trials", "2.5", "not a whole number"), ("--steps", "0", "is 0"), ("--trial-timeout", "-1", "is -1"),
    ("--trial-timeout", "soon", "not a number"), ("--seed", "-1", "is -1"), ("--tolerance", "1", "is 1"),
    ("--confidence", "0", "is 0"), ("--retries", "-1", "is -1"), ("--margin", "-0.1", "is -0.1"),
    ("--time-budget", "0", "is 0"), ("--reserve", "x", "not a whole number"),
]


@pytest.mark.parametrize(("flag", "value", "words"), BAD)
def test_a_bad_tune_option_is_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                       flag: str, value: str, words: str) -> None:
    code = main(["tune", "--home", str(tmp_path / "home"), flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"pipette: error: {flag}: ") and words in err[0] and "(fix: give " in err[0], err
    assert not (tmp_path / "home").exists()  # refused before anything was measured


@pytest.mark.parametrize(("flag", "value", "words"), [("--top", "0", "is 0"), ("--top", "ten", "not a whole number"),
                                                      ("--margin", "1", "is 1"), ("--margin", "x", "not a number")])
def test_a_bad_plan_option_is_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str], flag: str, value: str,
                                                       words: str) -> None:
    code = main(["plan", "--model", "tiny-llama", "--cluster", "examples/clusters/cpu-4.yaml", "--global-batch",
                 "16", "--seq-len", "128", "--no-files", flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith(f"pipette: error: {flag}: ") and words in err[0], err


def test_a_bad_submit_option_is_refused_before_the_service_is_asked(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("cluster: local\nmodel: tiny-llama\ntraining: {global_batch: 4, seq_len: 32}\n")
    monkeypatch.setenv("PIPETTE_URL", "http://127.0.0.1:9")  # nothing listens: asking it would say so
    assert main(["submit", str(job), "--steps", "none"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pipette: error: --steps: is 'none', not a whole number"), err


@pytest.mark.parametrize(("budget", "field"), [
    ({"max_trials": 0}, "budget.max_trials"), ({"max_trials": -1}, "budget.max_trials"),
    ({"max_trials": "8"}, "budget.max_trials"), ({"max_trials": 2.5}, "budget.max_trials"),
    ({"max_trials": 501}, "budget.max_trials"), ({"steps": 0}, "budget.steps"),
    ({"trial_timeout_s": 0}, "budget.trial_timeout_s"), ({"trial_timeout_s": "1"}, "budget.trial_timeout_s"),
    ({"seed": -1}, "budget.seed"), ({"prune": 1}, "budget.prune"), ({"margin": 1.0}, "budget.margin"),
    ({"tolerance": -0.1}, "budget.tolerance"), ({"retries": 6}, "budget.retries"), ({"colour": 1}, "budget.colour"),
])
def test_a_bad_budget_names_its_field(budget: dict[str, Any], field: str) -> None:
    from service.errors import validation_error
    from service.schemas import JobIn

    body = {"cluster": "local", "model": "tiny-llama", "training": {"global_batch": 4, "seq_len": 32},
            "budget": budget}
    with pytest.raises(ValidationError) as e:
        JobIn.model_validate(body)
    error = validation_error(e.value.errors())  # what the API answers (422, one error object)
    assert error.field == field and error.fix, error


def test_the_search_refuses_what_the_schema_cannot_say() -> None:
    from service.specs import tune_options

    with pytest.raises(SpecError) as e:
        tune_options({"max_trials": 4, "reserve": 4})
    assert e.value.field == "budget.reserve" and "max_trials" in (e.value.fix or "")
    assert tune_options({"max_trials": 3}) == TuneOptions(max_trials=3)  # a job stored with fewer options
