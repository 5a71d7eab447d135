"""qk_trial.penalty_version: which eigenspectrum-penalty definition trained a trial

Trials stored before this revision were trained with the v1 LocAteR-style penalty, so they
are labelled 1; new trials get the current version from the application (no server default
is left behind, so an insert that forgets the version fails instead of mislabelling).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 11:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("qk_trial") as batch:
        batch.add_column(
            sa.Column("penalty_version", sa.Integer(), server_default="1", nullable=False)
        )
    with op.batch_alter_table("qk_trial") as batch:
        batch.alter_column("penalty_version", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("qk_trial") as batch:
        batch.drop_column("penalty_version")
