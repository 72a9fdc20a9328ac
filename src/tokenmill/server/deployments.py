"""What the gateway serves: ``GET /v1/deployments`` and ``GET /v1/deployments/{id}``,
each deployment's configuration and state. (Its predict endpoints answer in OpenAI's
shapes: :mod:`tokenmill.server.openai.router`.)
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from tokenmill.gateway import Gateway
from tokenmill.server.intake import deployment_by_id
from tokenmill.server.openapi import errors
from tokenmill.server.protocol import DeploymentInfo, DeploymentList

router = APIRouter()


@router.get("/v1/deployments")
async def deployments(request: Request) -> DeploymentList:
    gw: Gateway = request.app.state.gateway
    return DeploymentList(
        object="list",
        data=[DeploymentInfo.model_validate(d.describe()) for d in gw.deployments.values()],
    )


@router.get("/v1/deployments/{deployment_id}", responses=errors(404))
async def deployment(request: Request, deployment_id: str) -> DeploymentInfo:
    gw: Gateway = request.app.state.gateway
    return DeploymentInfo.model_validate(deployment_by_id(gw, deployment_id).describe())
