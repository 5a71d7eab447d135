"""Why a pruned trial stopped (a constraint it could no longer meet, or the pruner's verdict);
which runner attempt claimed a trial after a dead runner (its attempts count once)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 16:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("qk_trial") as batch:
        batch.add_column(sa.Column("stop_reason", sa.Text(), nullable=True))
        batch.add_column(sa.Column("claimed_by", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("qk_trial") as batch:
        batch.drop_column("claimed_by")
        batch.drop_column("stop_reason")
