"""What a study's runner-job deaths were charged to: `job_failures` (the study or the
cluster, bounded by max_job_attempts) and `weather_relaunches` (the database away, a
submission Ray never took; bounded by max_weather_relaunches). `job_attempts` stays the
fence token and only goes up. An existing study's earlier relaunches were each charged as a
failure under the old rule (`job_attempts` counted them), so its `job_failures` starts at
`job_attempts - 1`: an upgrade gives no study its attempts back.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28 16:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("qk_study") as batch:
        batch.add_column(
            sa.Column("job_failures", sa.Integer(), nullable=False, server_default="0")
        )
        batch.add_column(
            sa.Column("weather_relaunches", sa.Integer(), nullable=False, server_default="0")
        )
    op.execute("UPDATE qk_study SET job_failures = job_attempts - 1 WHERE job_attempts > 1")


def downgrade() -> None:
    with op.batch_alter_table("qk_study") as batch:
        batch.drop_column("weather_relaunches")
        batch.drop_column("job_failures")
