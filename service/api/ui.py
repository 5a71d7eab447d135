"""/v1/ui/config: what the web UI needs to know about this deployment besides the data."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from service.api.deps import SettingsDep
from service.read.importance import MIN_TRIALS

__all__ = ["UiConfigOut", "router"]

router = APIRouter(prefix="/v1", tags=["ui"])


class UiConfigOut(BaseModel):
    ray_dashboard_url: str | None = Field(
        description="The Ray dashboard the API submits jobs to (its Jobs page links from the"
        " studies list); null when the API runs without Ray or reaches it by a ray:// address"
    )
    auth: bool = Field(description="whether the API asks for a bearer token")
    importance_min_trials: int = Field(
        description="COMPLETE trials /importance needs before it ranks parameters"
    )


@router.get("/ui/config", response_model=UiConfigOut)
def ui_config(settings: SettingsDep) -> UiConfigOut:
    """Links the pages draw (the Ray dashboard), behind the token like every data route."""
    address = settings.ray_address.rstrip("/")
    dashboard = address if address.startswith(("http://", "https://")) else None
    return UiConfigOut(
        ray_dashboard_url=dashboard,
        auth=bool(settings.token_list()),
        importance_min_trials=MIN_TRIALS,
    )
