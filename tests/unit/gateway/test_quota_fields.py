"""The seven quota limits appear in five places (seed file, table, admin body, admin patch, quota
service); they must name the same fields, or a limit would be silently dropped on its way."""

from __future__ import annotations

import dataclasses

import pytest

from sluice.gateway.admin.schemas import Quotas, QuotasPatch
from sluice.gateway.db.models import QUOTA_FIELDS, Quota
from sluice.gateway.quotas.service import QuotaLimits
from sluice.settings import QuotaSeed

pytestmark = pytest.mark.unit


def test_every_quota_representation_names_the_same_limits() -> None:
    expected = set(QUOTA_FIELDS)
    assert len(expected) == 7
    assert set(QuotaSeed.__struct_fields__) == expected
    assert set(Quotas.__struct_fields__) == expected
    assert set(QuotasPatch.__struct_fields__) == expected
    assert {f.name for f in dataclasses.fields(QuotaLimits)} == expected
    assert expected <= set(Quota.__table__.columns.keys())
