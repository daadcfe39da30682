"""Corpora: uploaded UTF-8 texts that training requests name.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('corpora',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('filename', sa.String(length=255), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('chars', sa.BigInteger(), nullable=False),
    sa.Column('vocab_size', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['sha256'], ['artifacts.sha256'], name=op.f('fk_corpora_sha256_artifacts')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_corpora')),
    sa.UniqueConstraint('sha256', name=op.f('uq_corpora_sha256'))
    )


def downgrade() -> None:
    op.drop_table('corpora')
