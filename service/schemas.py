"""The API's request and response shapes (pydantic), documented in docs/service.md "The API".

Requests are checked twice: here for types and ranges (so a bad field answers 422 naming it
before anything runs), then by the core (``TrainingSpec.from_dict``, ``ModelSpec``,
``cluster_from_dict``) for meaning. Responses carry the core's own ``to_dict`` forms where the
core has one (model, recipe, plan, measurement), so the CLI and the service agree.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from pipette.model import MODEL_PRESETS
from pipette.options import OPTIONS, Option, Scope, Value, describe, options_for
from service.settings import MAX_BODY_BYTES_CEILING

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
#: ids are UUIDs; anything else cannot name a row (and never reaches the database)
ID_PATTERN = r"^[0-9a-fA-F-]{1,36}$"
#: free text (job names): no control characters (PostgreSQL refuses NUL in text)
TEXT_PATTERN = r"^[^\x00-\x1f\x7f]*$"
# Ray addresses: host:port, ray://host:port, or "auto"; nothing a shell would read specially.
ADDRESS_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/\[\]-]{0,499}$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- errors ---------------------------------------------------------------------------

class ErrorDetail(BaseModel):
    message: str
    field: str | None
    fix: str | None


class ErrorOut(BaseModel):
    """Every 4xx/5xx answer."""

    error: ErrorDetail


# ---- clusters -------------------------------------------------------------------------

class NodeIn(Strict):
    name: str = Field(min_length=1, max_length=200, pattern=NAME_PATTERN)
    address: str = Field("", max_length=500, pattern=r"^[A-Za-z0-9._:\[\]-]*$")
    devices: int = Field(ge=1, le=1024, description="devices of this node the jobs may use")


class ClusterIn(Strict):
    name: str = Field(pattern=NAME_PATTERN, description="unique within the tenant")
    kind: Literal["local", "ray"] = Field(
        "local", description="local: this host's embedded Ray, CPU devices with gloo; ray: a Ray cluster")
    devices: int = Field(2, ge=1, le=1024, description="devices per node (CPU worker processes where no GPU)")
    address: str | None = Field(None, pattern=ADDRESS_PATTERN, description="the Ray address (kind ray)")
    nodes: list[NodeIn] = Field(default_factory=list, max_length=4096,
                                description="kind ray: the nodes to use (empty: every node Ray sees)")


class ProfileOut(BaseModel):
    id: str
    cluster_id: str
    url: str
    state: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: ErrorDetail | None
    #: the measured ClusterProfile (pipette.cluster.ClusterProfile.to_dict): nodes, devices
    #: with memory and compute peaks, and the link matrix (bandwidth bytes/s, latency s)
    profile: dict[str, Any] | None


class LeaseOut(BaseModel):
    busy: bool
    job_id: str | None
    profile_id: str | None
    expires_at: datetime | None
    #: when a scheduler serving these devices last looked for work (None: never)
    served_at: datetime | None = None


class ClusterOut(BaseModel):
    id: str
    url: str
    name: str
    kind: Literal["local", "ray"]
    address: str
    nodes: list[dict[str, Any]]
    devices_per_node: int
    created_at: datetime
    lease: LeaseOut
    latest_profile: ProfileOut | None


class ClusterList(BaseModel):
    items: list[ClusterOut]


# ---- jobs -----------------------------------------------------------------------------

class StrictTypes(Strict):
    """No coercion: ``true`` is not 1 and ``"8"`` is not 8 (issue 17, item 14); NaN and
    infinities are refused as such, not as out of bounds (item 19)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class LoraIn(StrictTypes):
    rank: int = Field(16, ge=1, le=65536)
    alpha: float = Field(32.0, gt=0, le=1e6)
    targets: list[Annotated[str, Field(max_length=40)]] | None = Field(None, min_length=1, max_length=16)


class TrainingIn(StrictTypes):
    """The recipe (pipette.training.TrainingSpec); omitted lists allow every option."""

    global_batch: int = Field(ge=1, le=1 << 24)
    seq_len: int = Field(ge=1, le=1 << 24)
    dtype: Literal["bf16", "fp16", "fp32", "tf32"] = "bf16"
    optimizer: Literal["adamw", "adam", "sgd"] = "adamw"
    method: Literal["full", "lora"] = "full"
    lora: LoraIn | None = None
    recompute: list[Literal["none", "selective", "full"]] | None = Field(None, min_length=1, max_length=3)
    zero_stages: list[Literal[0, 1, 2, 3]] | None = Field(None, min_length=1, max_length=4)
    schedules: list[Literal["1f1b", "interleaved"]] | None = Field(None, min_length=1, max_length=2)
    micro_batches: list[Annotated[int, Field(ge=1, le=1 << 24)]] | None = Field(None, min_length=1, max_length=32)
    max_virtual_stages: int = Field(4, ge=1, le=64)
    document_len: int | None = Field(None, ge=1, le=1 << 24, description="packed sequences: the documents' "
                                     "length in tokens, each attending within itself where the stack's attention "
                                     "keeps to documents (null: one document a sequence)")
    moe_routing: list[Annotated[str, Field(max_length=16)] | float] | None = Field(
        None, min_length=1, max_length=8, description="an MoE model's routings the search may plan: dropless and "
        "capacity factors (1.0, 1.25: tokens past an expert's capacity are dropped) (null: the model's own)")

    def to_spec_dict(self) -> dict[str, Any]:
        data = self.model_dump(exclude_none=True)
        if self.lora is not None:
            data["lora"] = self.lora.model_dump(exclude_none=True)
        return data


def option_field(option: Option) -> tuple[Any, Any]:
    """``option`` as a pydantic field: its type (None allowed where it is the default), default,
    bounds (the service's cap on top of the meaning's) and help."""
    text, default = describe(option, FIELD_NAMES)
    if option.optional:
        text += f" (null: {default.removeprefix('default: ')})"
    bounds = {k: getattr(option, k) for k in ("ge", "gt", "le", "lt") if getattr(option, k) is not None}
    if option.cap is not None:
        bounds["le"] = min(bounds.get("le", option.cap), option.cap)
    kind = option.kind | None if option.optional else option.kind
    return kind, Field(option.default, description=text, **bounds)


def option_fields(scope: Scope) -> dict[str, Any]:
    return {o.name: option_field(o) for o in options_for(scope)}


def given_options(body: BaseModel, scope: Scope) -> dict[str, Value]:
    """The options of ``scope`` in a request body whose fields ``option_fields`` made."""
    return {o.name: getattr(body, o.name) for o in options_for(scope)}


#: how the API names each option in the options' help (``{max_trials}``)
FIELD_NAMES = {o.name: f"`{o.name}`" for o in OPTIONS}

if TYPE_CHECKING:
    BudgetIn = StrictTypes
else:
    #: The search budget, the stop rule and the trials' length (pipette.options, scope "tune").
    BudgetIn = create_model("BudgetIn", __base__=StrictTypes, __doc__="The search budget and the stop rule "
                            "(pipette.tuner.TuneOptions), and the trials' length: pipette.options.",
                            **option_fields("tune"))


if TYPE_CHECKING:
    Preset = str
else:
    #: The model presets, as an enum in the OpenAPI schema (pipette.model.MODEL_PRESETS).
    Preset = Literal[tuple(sorted(MODEL_PRESETS))]
#: A preset name, or the content of a Hugging Face config.json.
ModelIn = Preset | dict[str, Any]


class ScriptIn(StrictTypes):
    """The user's own training script (``pipette.script.ScriptSpec``): allowed only on clusters
    whose operator enabled scripts for the tenant (``pipette-admin cluster allow-scripts``)."""

    argv: list[Annotated[str, Field(min_length=1, max_length=4096)]] = Field(
        min_length=1, max_length=256,
        description='the command that trains, as an argument list: ["python", "train.py"]')
    kind: Literal["hf-trainer", "deepspeed", "accelerate-fsdp", "torchtitan"] | None = Field(
        None, description="fills the knobs of a known stack")
    knobs: dict[str, str] = Field(default_factory=dict, max_length=16,
                                  description="knob -> the script's flag (pipette.script.KNOBS)")
    autotp: bool = False
    pipeline: bool = False
    unsupported: list[Literal["tp", "pp", "selective", "full", "hsdp", "offload"]] = Field(
        default_factory=list, max_length=6,
        description="what the script cannot run (pipette.script.UNSUPPORTED): no candidate using it is tried; "
        "empty: what its kind cannot run (as `pipette tune --script-unsupported`)")
    base_config: dict[str, Any] | None = Field(None, description="the user's DeepSpeed config, which Pipette's keys "
                                               "overlay")
    # The request body bounds it first (PIPETTE_MAX_BODY_BYTES); this bound is that setting's ceiling.
    files: str = Field(default="", max_length=MAX_BODY_BYTES_CEILING,
                       description="the working directory the script runs in, zipped and base64-encoded "
                       "(`pipette submit` sends it); empty: the script must be on every node already. The "
                       "whole request body, this included, is bounded by the service's PIPETTE_MAX_BODY_BYTES "
                       "(1 MiB by default, at most 64 MiB; GET /v1/limits says the value in force)")


#: A stack name with its options, or several separated by commas (pipette.stacks.get_stacks says
#: which are known).
STACK_PATTERN = r"^[A-Za-z0-9+_, -]+$"
STACK_DOC = ("the software that runs the job: pipette, hf-deepspeed, megatron, nanotron, fsdp; an option with +: "
             "fsdp+compile; several side by side with commas: pipette,fsdp (docs/stacks.md)")


class JobIn(Strict):
    cluster: str = Field(pattern=NAME_PATTERN, max_length=200, description="a cluster id or name of this tenant")
    model: ModelIn = Field(description="a preset name (tiny-llama, llama2-7b, ...) or a config.json object")
    training: TrainingIn
    budget: BudgetIn = Field(default_factory=lambda: BudgetIn.model_validate({}))
    name: str = Field("", max_length=200, pattern=TEXT_PATTERN)
    script: ScriptIn | None = Field(None, description="train with the user's own script instead of Pipette's runner")
    stack: str | None = Field(None, max_length=64, pattern=STACK_PATTERN, description=STACK_DOC + "; default: "
                              "pipette, or hf-deepspeed for an hf-trainer script. Without a script only a stack "
                              "Pipette's runner runs (pipette)")


class Progress(BaseModel):
    trials_done: int = 0
    trials_ok: int = 0
    max_trials: int = 0
    running_trial: int | None = None
    tuning_s: float = 0.0
    #: the addresses of lost Ray nodes the job waits for before its next trial; absent otherwise
    waiting_for_nodes: list[str] | None = None


class BestSummary(BaseModel):
    trial: int
    label: str
    config: dict[str, Any]
    measured_step_time: float | None
    tokens_per_s: float | None
    predicted_step_time: float | None


class JobLinks(BaseModel):
    self: str
    trials: str
    best: str
    plan: str
    events: str
    cancel: str


class JobOut(BaseModel):
    id: str
    url: str
    name: str
    state: Literal["queued", "profiling", "planning", "running", "succeeded", "failed", "cancelled"]
    cluster_id: str
    model: dict[str, Any]
    training: dict[str, Any]
    budget: dict[str, Any]
    #: the stack it is tuned for (``pipette.stacks``)
    stack: str = "pipette"
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    cancel_requested: bool
    attempts: int
    progress: Progress
    best: BestSummary | None
    stop_reason: str | None
    error: ErrorDetail | None
    #: why a queued job does not start (no scheduler serves its cluster's devices), else None
    notice: str | None = None
    links: JobLinks


class JobAccepted(BaseModel):
    id: str
    url: str
    state: str


class JobList(BaseModel):
    items: list[JobOut]
    next_cursor: str | None


class TrialOut(BaseModel):
    number: int
    state: Literal["running", "ok", "oom", "failed", "timeout", "pruned", "interrupted"]
    label: str
    config: dict[str, Any]
    predicted_step_time: float | None
    analytic_step_time: float | None
    predicted_peak_bytes: int | None
    measured_step_time: float | None
    tokens_per_s: float | None
    peak_memory_bytes: int | None
    #: (measured - predicted) / predicted
    prediction_error: float | None
    error: str | None
    attempt: int
    runs: int
    started_at: datetime
    ended_at: datetime | None
    duration_s: float | None


class TrialDetail(TrialOut):
    #: every step as it streamed in: [{step, time, warmup}]
    steps: list[dict[str, Any]]
    #: the tuner's TrialRecord dict of the last attempt (measurement with every step time,
    #: losses, peak memory, the estimates it was proposed with)
    record: dict[str, Any] | None
    #: every attempt's TrialRecord dict (more than one when a failed attempt was retried)
    attempts: list[dict[str, Any]]


class TrialList(BaseModel):
    items: list[TrialOut]


class BestOut(BaseModel):
    job_id: str
    trial: TrialOut
    config: dict[str, Any]
    #: None for a job that runs no DeepSpeed (Pipette's native runner, the fsdp stack)
    ds_config: dict[str, Any] | None
    launch_command: str
    hostfile: str
    rank_map: list[dict[str, Any]]
    #: download links, by file name
    files: dict[str, str]


# ---- planning -------------------------------------------------------------------------

class PlanBody(Strict):
    model: ModelIn
    training: TrainingIn
    cluster: Annotated[str, Field(pattern=NAME_PATTERN, max_length=100)] | dict[str, Any] = Field(
        description="a cluster file as an object (see docs/inputs.md, Cluster file), or a registered cluster's "
                    "id or name (its latest profile)")
    stack: str | None = Field(None, max_length=64, pattern=STACK_PATTERN, description=STACK_DOC + "; default pipette")


if TYPE_CHECKING:
    PlanIn = PlanBody
else:
    #: The what-if body: the plan's options (``margin``, ``top``) from pipette.options, scope "plan".
    PlanIn = create_model("PlanIn", __base__=PlanBody, **option_fields("plan"))


class PlanOut(BaseModel):
    """``pipette plan --json``'s object: ranked candidates, drop counts and the out-of-memory list."""

    model_config = ConfigDict(extra="allow")
    model: dict[str, Any]
    training: dict[str, Any]
    cluster: dict[str, Any]
    enumerated: int
    feasible: int
    dropped: dict[str, Any]
    ranked: list[dict[str, Any]]
    out_of_memory: list[dict[str, Any]]
    planning_seconds: float


# ---- operations -----------------------------------------------------------------------

class Health(BaseModel):
    status: Literal["ok"]


class Limits(BaseModel):
    """What this service takes, for a client to check before it sends."""

    max_body_bytes: int = Field(description="the largest request body taken (413 above it), a script's working "
                                "folder included (base64: 4/3 of its zip)")
    setting: Literal["PIPETTE_MAX_BODY_BYTES"] = Field(
        default="PIPETTE_MAX_BODY_BYTES", description="the operator's setting that raises it (at most 64 MiB)")


class Readiness(BaseModel):
    status: Literal["ready", "not ready"]
    checks: dict[str, dict[str, Any]]
