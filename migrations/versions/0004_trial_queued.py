"""QUEUED trials: started_at is set when the trial's task really starts; waiting reasons

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 11:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("qk_trial") as batch:
        batch.alter_column("started_at", existing_type=sa.DateTime(timezone=True), nullable=True)
        batch.add_column(sa.Column("waiting_reason", sa.Text(), nullable=True))
    with op.batch_alter_table("qk_study") as batch:
        batch.add_column(sa.Column("waiting_reason", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("qk_study") as batch:
        batch.drop_column("waiting_reason")
    op.execute("UPDATE qk_trial SET started_at = CURRENT_TIMESTAMP WHERE started_at IS NULL")
    op.execute("UPDATE qk_trial SET state = 'RUNNING' WHERE state = 'QUEUED'")
    with op.batch_alter_table("qk_trial") as batch:
        batch.drop_column("waiting_reason")
        batch.alter_column("started_at", existing_type=sa.DateTime(timezone=True), nullable=False)
