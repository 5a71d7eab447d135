"""qk_trial.metric_rows: metric rows stored per finished trial

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 11:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("qk_trial") as batch:
        batch.add_column(sa.Column("metric_rows", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("qk_trial") as batch:
        batch.drop_column("metric_rows")
