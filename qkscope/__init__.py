"""qkscope from Python: `Client` talks to a running qkscope service (`qkscope serve`).

    from qkscope import Client
    qk = Client()                       # QKSCOPE_API_URL / QKSCOPE_API_TOKEN, or arguments
    study = qk.submit("study_defs/quickstart.yaml")
    qk.wait(study.id)                   # progress bar (notebook bar in Jupyter)
    qk.trials(study.id, state="COMPLETE").to_pandas()
    qk.plot(study.id, "scatter", x="params.regularizer.lambda", y="min_norm_entropy")

Importing this package loads no torch, Ray or server code.
"""

from qkscope.client import Client
from qkscope.errors import ApiError, ConnectError, QkscopeError
from qkscope.models import (
    Importance,
    LrCurvePoint,
    LrGroup,
    LrSensitivity,
    MetricPoint,
    MetricSeries,
    Plot,
    StabilityBoundary,
    StabilityGroup,
    Study,
    StudyList,
    Summary,
    Trial,
    TrialList,
)

__all__ = [
    "ApiError",
    "Client",
    "ConnectError",
    "Importance",
    "LrCurvePoint",
    "LrGroup",
    "LrSensitivity",
    "MetricPoint",
    "MetricSeries",
    "Plot",
    "QkscopeError",
    "StabilityBoundary",
    "StabilityGroup",
    "Study",
    "StudyList",
    "Summary",
    "Trial",
    "TrialList",
]
