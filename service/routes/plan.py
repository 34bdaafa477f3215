"""``POST /v1/plan``: the core's what-if answer (no trials) for a cluster the caller describes,
or for a registered cluster's latest profile."""

from __future__ import annotations

import time

from fastapi import APIRouter

from pipette.cluster import ClusterProfile
from pipette.clusterfile import cluster_from_dict
from pipette.plan import DEFAULT_MARGIN, check_recipe, make_plan
from pipette.stacks import get_stacks
from service.deps import Caller, State
from service.errors import NotFoundError
from service.planning import plan_dict
from service.repositories import clusters as cluster_repo
from service.routes import AUTHED, errors
from service.schemas import PlanIn, PlanOut, given_options
from service.specs import cluster_file, model_spec, training_spec

router = APIRouter(prefix="/v1", tags=["planning"])


@router.post("/plan", response_model=PlanOut, responses=errors(*AUTHED, 404, 429))
def what_if(body: PlanIn, state: State, caller: Caller) -> PlanOut:
    """Rank every candidate likely enough to fit by the step time to expect; say why the others drop.
    A tenant may ask for ``PIPETTE_PLANS_PER_MINUTE`` plans a minute (429 above it)."""
    state.plans.take(caller.tenant)
    model = model_spec(body.model)
    training = training_spec(body.training)
    check_recipe(model, training)
    stack = get_stacks(body.stack)  # an unknown one is refused before the cluster is read
    cluster = _cluster(body, state, caller.tenant)
    options = given_options(body, "plan")
    margin = DEFAULT_MARGIN if options["margin"] is None else float(options["margin"])
    start = time.perf_counter()
    plan = make_plan(model, training, cluster, margin=margin, stack=stack)
    return PlanOut(**plan_dict(plan, top=int(options["top"] or 0), planning_seconds=time.perf_counter() - start))


def _cluster(body: PlanIn, state: State, tenant: str) -> ClusterProfile:
    if isinstance(body.cluster, dict):
        return cluster_file(body.cluster)
    with state.db.read() as session:
        cluster = cluster_repo.get_cluster(session, tenant, body.cluster)
        profile = cluster_repo.latest_profile(session, cluster.id)
    if profile is None or profile.profile is None:
        raise NotFoundError(f"cluster {cluster.name!r} has not been profiled yet", field="cluster",
                            fix=f"POST /v1/clusters/{cluster.id}/profile, or describe the cluster as an object")
    return cluster_from_dict(profile.profile)
