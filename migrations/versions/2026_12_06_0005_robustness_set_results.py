"""Certified-accuracy results: the verdicts of one (model, inputs and labels, norm, radius),
stored once so that a certified-accuracy certificate for another threshold, or the same
request after its job ended, is signed without deciding the inputs again.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('robustness_set_results',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('model_id', sa.String(length=36), nullable=False),
    sa.Column('request_key', sa.String(length=64), nullable=False),
    sa.Column('norm', sa.String(length=8), nullable=False),
    sa.Column('radius', sa.Float(), nullable=False),
    sa.Column('n', sa.Integer(), nullable=False),
    sa.Column('inputs_sha256', sa.String(length=64), nullable=False),
    sa.Column('certified_accuracy', sa.Float(), nullable=False),
    sa.Column('result', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['model_id'], ['models.id'], name=op.f('fk_robustness_set_results_model_id_models'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_robustness_set_results')),
    sa.UniqueConstraint('request_key', name=op.f('uq_robustness_set_results_request_key'))
    )
    with op.batch_alter_table('robustness_set_results', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_robustness_set_results_model_id'), ['model_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('robustness_set_results', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_robustness_set_results_model_id'))
    op.drop_table('robustness_set_results')
