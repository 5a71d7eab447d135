"""/v1/ui/config: what the web UI needs to know about this deployment besides the data;
/v1/ui/session: the cookie that opens the UI's own files (service/ui/__init__.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response, status
from pydantic import BaseModel, Field

from service.api.deps import SettingsDep, token_digest
from service.read.importance import MIN_TRIALS
from service.ui import COOKIE, UI_PATH, ui_cookie

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


# The web UI's own plumbing, like its files: behind the token, left out of the OpenAPI document.
@router.post(
    "/ui/session",
    status_code=status.HTTP_204_NO_CONTENT,
    response_class=Response,
    include_in_schema=False,
)
def open_ui(request: Request) -> Response:
    """For the bearer token this request carries (checked like every route's), the cookie
    `qkscope_ui` that lets this browser load the UI's files (HttpOnly, SameSite=Strict,
    Path=/ui, Secure over https); it opens no data route. Without tokens configured: 204 and
    no cookie (the files need none)."""
    response = Response(status_code=status.HTTP_204_NO_CONTENT)
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if request.app.state.token_digests and scheme.lower() == "bearer" and token:
        response.set_cookie(
            COOKIE,
            ui_cookie(token_digest(token.strip())),
            path=UI_PATH,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
    return response


@router.delete(
    "/ui/session",
    status_code=status.HTTP_204_NO_CONTENT,
    response_class=Response,
    include_in_schema=False,
)
def close_ui() -> Response:
    """Forget the UI cookie in this browser (the page's "forget token")."""
    response = Response(status_code=status.HTTP_204_NO_CONTENT)
    response.delete_cookie(COOKIE, path=UI_PATH, httponly=True, samesite="strict")
    return response
