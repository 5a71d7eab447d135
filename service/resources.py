"""Can any node of the Ray cluster ever run one trial of a study?

Ray keeps a task that no node can fit pending forever, so a study asking for a GPU on a
CPU-only cluster would otherwise hang silently. The API asks this before it accepts a study
(when it can reach the cluster), and the runner asks it again for trials that wait in Ray's
queue, to put a visible waiting reason on the study and its trials.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["unmet"]


def unmet(cpus: float, gpus: float, nodes: Sequence[Mapping[str, float]]) -> list[tuple[str, str]]:
    """(spec field, message) for what no single node can provide; [] when one node can.

    `nodes` are the total resources of the alive nodes (Ray's names: "CPU", "GPU").
    """
    if any(n.get("CPU", 0.0) >= cpus and n.get("GPU", 0.0) >= gpus for n in nodes):
        return []
    most_cpu = max((n.get("CPU", 0.0) for n in nodes), default=0.0)
    most_gpu = max((n.get("GPU", 0.0) for n in nodes), default=0.0)
    out: list[tuple[str, str]] = []
    if gpus > most_gpu:
        out.append(
            (
                "resources.gpus",
                f"no node of the Ray cluster has {gpus:g} GPU(s) "
                f"(the most on one node: {most_gpu:g}, {len(nodes)} nodes)",
            )
        )
    if cpus > most_cpu:
        out.append(
            (
                "resources.cpus",
                f"no node of the Ray cluster has {cpus:g} CPU(s) "
                f"(the most on one node: {most_cpu:g}, {len(nodes)} nodes)",
            )
        )
    if not out:
        out.append(
            (
                "resources",
                f"no node of the Ray cluster has {cpus:g} CPU(s) and {gpus:g} GPU(s) together",
            )
        )
    return out
