"""The study runner: the Ray Job that runs one study (`python -m service.runner <id> <attempt>`).

Read it in this order: `loop.py` (schedule -> run -> post-process), `records.py` (a trial's
record and its status), `scheduler.py` (the only owner of that status: waiting queue, slot
workers, placement), `pool.py` (Ray: the inbox and the workers' tasks), `search.py`
(Optuna), `reports.py` and `results.py` (what comes back), `job.py` (the entrypoint).
"""

from service.runner.job import main, run_study

__all__ = ["main", "run_study"]
