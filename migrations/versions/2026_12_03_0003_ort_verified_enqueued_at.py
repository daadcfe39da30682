"""Models record that onnxruntime agreed with the torch evaluation at upload (later loads skip
the comparison); jobs record when their message was last sent (stranded messages are resent).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('models') as batch:
        batch.add_column(sa.Column('ort_verified_at', sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('enqueued_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('enqueued_at')
    with op.batch_alter_table('models') as batch:
        batch.drop_column('ort_verified_at')
